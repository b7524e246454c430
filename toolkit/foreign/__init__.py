"""Real phone traces, read into edgeprobe's own Trace: what researchers already record with their tools.

    load_foreign(path, format="auto", mhz=None) -> Trace     every event measured (real hardware times), emulated False

Formats with a reader (each checked against real excerpts quoted from public threads, tests/data/foreign):
  llamacpp-hexagon-op   llama.cpp Hexagon backend per-op profile lines on stderr (its 2025 format)
  chrome-json           Chrome trace-event JSON (Perfetto legacy JSON), e.g. exported from a Hexagon profile
  llamacpp-opencl-csv   llama.cpp OpenCL backend's cl_profiling.csv (GGML_OPENCL_PROFILING, Adreno GPUs)
  executorch-etdump     ExecuTorch's ETDump (.etdp), the runtime's per-op and per-method profile events
  qnn-optrace           Qualcomm QNN HTP optrace (qnn-profile-viewer's Chrome JSON, HTP cycles -> us by the clock of
                        the run trace beside it, or mhz)
align.py matches an imported trace to the model template's ops; fit.py fits a cost model from the aligned ops.
"""
from __future__ import annotations

from .base import ForeignTraceError
from .read import FORMATS, READERS, detect_format, read_foreign

__all__ = ["FORMATS", "READERS", "ForeignTraceError", "detect_format", "load_foreign", "read_foreign"]


def load_foreign(path, format: str = "auto", mhz: float | None = None):
    """A foreign trace file -> Trace (meta: source {tool, format, version}, skipped records, the time conversion).
    mhz: the clock of a cycle-counted trace that does not state it (a QNN optrace without its run trace)."""
    from ..trace import Trace  # here: trace imports foreign.base, which runs this package first

    return Trace(*read_foreign(path, format, mhz=mhz))
