"""Real phone traces, read into edgeprobe's own Trace: what researchers already record with their tools.

    load_foreign(path, format="auto") -> Trace     every event measured (real hardware times), emulated False

Formats with a reader (each checked against real excerpts quoted from public threads, tests/data/foreign):
  llamacpp-hexagon-op   llama.cpp Hexagon backend per-op profile lines on stderr (its 2025 format)
  chrome-json           Chrome trace-event JSON (Perfetto legacy JSON), e.g. exported from a Hexagon profile
align.py matches an imported trace to the model template's ops; fit.py fits a cost model from the aligned ops.
"""
from __future__ import annotations

from pathlib import Path

from ..trace import Trace
from . import chrome_json, llamacpp_hexagon
from .base import ForeignTraceError, read_text

READERS = {llamacpp_hexagon.FORMAT: llamacpp_hexagon, chrome_json.FORMAT: chrome_json}
FORMATS = tuple(READERS)

__all__ = ["FORMATS", "ForeignTraceError", "detect_format", "load_foreign"]


def detect_format(path) -> str:
    """The format of the file at `path`, from its first bytes and lines."""
    text = read_text(path, "one of: " + ", ".join(FORMATS))
    for fmt, mod in READERS.items():
        if mod.sniff(text):
            return fmt
    if "profile-op " in text:
        raise ForeignTraceError(path, "whole file", "llama.cpp Hexagon 'profile-op'/'trace-op' lines (the 2026 format) "
                                "have no reader yet: no public sample was found to check one against",
                                "one of: " + ", ".join(FORMATS))
    raise ForeignTraceError(path, "whole file", "no known trace format recognized", "one of: " + ", ".join(FORMATS))


def load_foreign(path, format: str = "auto") -> Trace:
    """A foreign trace file -> Trace (meta: source {tool, format, version}, skipped records, the time conversion)."""
    if format == "auto":
        format = detect_format(path)
    if format not in READERS:
        raise ForeignTraceError(path, "argument", f"unknown format {format!r}", "one of: auto, " + ", ".join(FORMATS))
    trace = READERS[format].read(Path(path))
    trace.meta.setdefault("path", str(path))
    return trace
