"""edgeprobe: profile, quantize, schedule and run LLMs the way on-device papers do, and see the timeline.

Host side. `edgeprobe.models.load` gives a real checkpoint; `edgeprobe.forward.forward` is the one
forward pass; `edgeprobe.evaluate.perplexity` scores it.
"""
__version__ = "0.1.0"

from . import errors  # noqa: F401


def __getattr__(name):
    """edgeprobe.Device / edgeprobe.Trace without importing ZeroMQ for every `import edgeprobe`."""
    if name == "Device":
        from .device import Device
        return Device
    if name == "Trace":
        from .trace import Trace
        return Trace
    raise AttributeError(f"module 'edgeprobe' has no attribute {name!r}")
