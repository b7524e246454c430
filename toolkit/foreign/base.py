"""What every reader of a foreign trace shares: its error and how an imported event looks."""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import EdgeprobeError

CHROME_KEY = "edgeprobe_chrome"  # otherData's entry that marks a file edgeprobe wrote (trace.py): its time origin (µs)


class ForeignTraceError(EdgeprobeError, ValueError):
    """A file that is not a readable trace of the format asked for (truncated, an unknown record, another format)."""

    def __init__(self, path, where: str, what: str, expected: str):
        super().__init__(f"{path}: {where}: {what}; expected {expected}")
        self.path, self.where, self.expected = str(path), where, expected


def read_text(path, expected: str) -> str:
    """The file's text (bytes that are not UTF-8 replaced: device logs mix encodings)."""
    p = Path(path)
    if not p.is_file():
        raise ForeignTraceError(p, "file", "no such file", expected)
    return p.read_bytes().decode("utf-8", errors="replace")


def event(name: str, kind: str, lane: str, start_us: float, end_us: float, layer: int = -1, **extra) -> dict:
    """One imported event in edgeprobe's Trace vocabulary: measured on real hardware, never emulated."""
    return {"name": name, "kind": kind, "lane": lane, "layer": layer, "chunk": 0, "start_us": float(start_us),
            "end_us": float(end_us), "measured": True, "emulated": False, **extra}


def ggml_dims(text: str) -> list[int]:
    """"4096:64:1:1" -> [4096, 64, 1, 1]: ggml's ne0:ne1:... (ne0 the contiguous, innermost dimension)."""
    return [int(v) for v in text.split(":") if v != ""]


def ggml_layer(*texts) -> int:
    """The layer a llama.cpp tensor name says ("blk.3.attn_q.weight", "Qcur-3"), from the first text that says one;
    -1 for none."""
    for t in texts:
        if isinstance(t, str):
            m = re.search(r"blk\.(\d+)", t) or re.search(r"-(\d+)(?: \(|$)", t)
            if m:
                return int(m[1])
    return -1
