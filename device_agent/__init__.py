"""edgeprobe_agent: the process that runs on the device (ZeroMQ server, blob store, executor, lanes).

Depends only on numpy, numba, pyzmq, msgpack and optionally pyopencl, so it also runs under Termux
on a phone; it never imports `edgeprobe`. Subpackages: `ops` (the op registry and the ops) and `store` (the blob
store), one module per job.
"""
__version__ = "0.1.0"
