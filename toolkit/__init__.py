"""edgeprobe: profile, quantize, schedule and run LLMs the way on-device papers do, and see the timeline.

Host side. `edgeprobe.models.load` gives a real checkpoint; `edgeprobe.forward.forward` is the one
forward pass; `edgeprobe.evaluate.perplexity` scores it.
"""
__version__ = "0.1.0"

from . import errors  # noqa: F401


def _offline_notebook_figures() -> None:
    """In a Jupyter kernel, figures carry offline HTML (plotly.js embedded once) beside plotly's MIME type, so a
    notebook executed by any route (nbconvert, papermill, JupyterLab's export) keeps its figures; an explicit
    PLOTLY_RENDERER or a renderer the user chose wins."""
    import os
    import sys

    if "ipykernel" not in sys.modules or os.environ.get("PLOTLY_RENDERER"):
        return
    try:
        import plotly.io as pio
    except ImportError:  # plotly is a dependency; a broken install must not break `import edgeprobe`
        return
    if pio.renderers.default == "plotly_mimetype":  # plotly's own default in a kernel: live only, blank when exported
        pio.renderers.default = "plotly_mimetype+notebook"


_offline_notebook_figures()


def __getattr__(name):
    """edgeprobe.Device / edgeprobe.Trace without importing ZeroMQ for every `import edgeprobe`."""
    if name == "Device":
        from .device import Device
        return Device
    if name == "Trace":
        from .trace import Trace
        return Trace
    raise AttributeError(f"module 'edgeprobe' has no attribute {name!r}")
