"""edgeprobe_agent: the process that runs on the device (ZeroMQ server, blob store, executor, lanes).

Depends only on numpy, numba, pyzmq, msgpack and optionally pyopencl, so it also runs under Termux
on a phone; it never imports `edgeprobe`. The server arrives with the device-agent issue.
"""
__version__ = "0.1.0"
