"""Which foreign format a file is, and its reader: a file -> (events, meta) of a Trace. Imports no Trace, so
edgeprobe.trace can read other tools' files through it (Trace.load, Trace.load_foreign) without an import cycle."""
from __future__ import annotations

import inspect
from pathlib import Path

from . import chrome_json, executorch_etdump, llamacpp_hexagon, llamacpp_hexagon_prof, llamacpp_opencl, qnn_profile
from .base import ForeignTraceError, read_text

READERS = {llamacpp_hexagon.FORMAT: llamacpp_hexagon, llamacpp_hexagon_prof.FORMAT: llamacpp_hexagon_prof,
           chrome_json.FORMAT: chrome_json,
           llamacpp_opencl.FORMAT: llamacpp_opencl, executorch_etdump.FORMAT: executorch_etdump,
           qnn_profile.FORMAT: qnn_profile}
FORMATS = tuple(READERS)
# QNN's optrace is Chrome JSON whose ts/dur are cycles: every specific format is sniffed before the generic one
_SNIFF_ORDER = sorted(READERS, key=lambda f: f == chrome_json.FORMAT)


def detect_format(path) -> str:
    """The format of the file at `path`, from its first bytes and lines."""
    text = read_text(path, "one of: " + ", ".join(FORMATS))
    for fmt in _SNIFF_ORDER:
        if READERS[fmt].sniff(text):
            return fmt
    if "profile-op " in text:
        raise ForeignTraceError(path, "whole file", "llama.cpp Hexagon 'profile-op' lines of a form between the "
                                "2025 and today's (' : '-separated fields, 'trace-op' lines): no reader for it; "
                                "today's '|'-separated lines are read", "one of: " + ", ".join(FORMATS))
    if text.lstrip().startswith('{"events"'):
        raise ForeignTraceError(path, "whole file", "a trace edgeprobe wrote (Trace.save): open it with Trace.load or "
                                "`edgeprobe trace show`", "another tool's trace, one of: " + ", ".join(FORMATS))
    raise ForeignTraceError(path, "whole file", "no known trace format recognized", "one of: " + ", ".join(FORMATS))


def read_foreign(path, format: str = "auto", mhz: float | None = None) -> tuple[list, dict]:
    """A foreign trace file -> (events, meta): meta has source {tool, format, version}, skipped records, the time
    conversion and the path. mhz: the clock of a format whose times are cycles and whose file may not state it
    (qnn-optrace without its run trace); refused by the formats that take none."""
    if format == "auto":
        format = detect_format(path)
    if format not in READERS:
        raise ForeignTraceError(path, "argument", f"unknown format {format!r}", "one of: auto, " + ", ".join(FORMATS))
    reader = READERS[format]
    if mhz is None:
        events, meta = reader.read(Path(path))
    elif "mhz" in inspect.signature(reader.read).parameters:
        events, meta = reader.read(Path(path), mhz=mhz)
    else:
        takes = [f for f, r in READERS.items() if "mhz" in inspect.signature(r.read).parameters]
        raise ForeignTraceError(path, "argument", f"mhz (--mhz) given, but a {format} file has no use for a clock",
                                "no mhz, or a format that takes one: " + ", ".join(takes))
    meta.setdefault("path", str(path))
    return events, meta
