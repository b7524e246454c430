"""ExecuTorch ETDump (`.etdp`): what an ExecuTorch runtime built with the event tracer writes, read by
`executorch.devtools.Inspector`. A flatbuffer (size-prefixed, file identifier "ED00") of schema
`devtools/etdump/etdump_schema_flatcc.fbs` (ETDUMP_VERSION 0):

    ETDump{version, run_data: [RunData{name, bundled_input_index, allocators, events: [Event{profile_event,
    allocation_event, debug_event}]}]}, ProfileEvent{name, chain_index, instruction_id, delegate_debug_id_int,
    delegate_debug_id_str, delegate_debug_metadata, start_time, end_time}

Each ProfileEvent becomes an event: kernel calls ("native_call_addmm.out", kind "addmm") and the runtime's own spans
("Method::execute", "OPERATOR_CALL": kind "runtime"; they enclose the calls) on the cpu lane, delegate calls (a
delegate debug id) on the "delegate" lane. Times are runtime ticks: ns on ExecuTorch's default (posix) platform, whose
et_pal_ticks_to_ns_multiplier is 1/1, and the Inspector's default source_time_scale; µs = ticks / 1000, counted from
the first event's start (a delegate's events may use its own unit: no sample with one was found to check against).
Allocation and debug events are counted, not read. The flatbuffer is walked here with a few bounds-checked table
reads, so importing needs neither the executorch nor the flatbuffers package.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path

from .base import ForeignTraceError, event

FORMAT = "executorch-etdump"
VERSION = 0  # ETDUMP_VERSION of devtools/etdump/etdump_flatcc.h: the schema this reader walks
EXPECTED = f"an ExecuTorch ETDump (.etdp: size-prefixed flatbuffer 'ED00', schema version {VERSION})"
_IDENT = b"ED00"


def sniff(text: str) -> bool:
    # the identifier sits at byte 8 (size-prefixed, as the runtime writes) or 4; non-UTF-8 bytes before it may have
    # been replaced by one character each, so look in the first 16 characters
    return _IDENT.decode() in text[:16]


class _Buf:
    """Bounds-checked reads of a flatbuffer: tables through their vtables, strings, vectors of tables."""

    def __init__(self, data: bytes, path):
        self.data, self.path = data, path

    def _unpack(self, fmt: str, pos: int):
        if pos < 0 or pos + struct.calcsize(fmt) > len(self.data):
            raise ForeignTraceError(self.path, f"byte {pos}", f"an offset points past the end of the "
                                    f"{len(self.data)}-byte file (truncated or not an ETDump)", EXPECTED)
        return struct.unpack_from(fmt, self.data, pos)[0]

    def field(self, table: int, index: int) -> int:
        """The absolute position of field `index` of the table at `table`, or 0 when absent (its default)."""
        vtable = table - self._unpack("<i", table)
        vt_len = self._unpack("<H", vtable)
        slot = 4 + 2 * index
        off = self._unpack("<H", vtable + slot) if slot < vt_len else 0
        return table + off if off else 0

    def scalar(self, table: int, index: int, fmt: str, default):
        pos = self.field(table, index)
        return self._unpack(fmt, pos) if pos else default

    def ref(self, pos: int) -> int:
        return pos + self._unpack("<I", pos)

    def table(self, table: int, index: int) -> int:
        pos = self.field(table, index)
        return self.ref(pos) if pos else 0

    def string(self, table: int, index: int) -> str | None:
        pos = self.field(table, index)
        if not pos:
            return None
        s = self.ref(pos)
        n = self._unpack("<I", s)
        if s + 4 + n > len(self.data):
            raise ForeignTraceError(self.path, f"byte {s}", "a string runs past the end of the file", EXPECTED)
        return self.data[s + 4:s + 4 + n].decode("utf-8", errors="replace")

    def tables(self, table: int, index: int) -> list[int]:
        pos = self.field(table, index)
        if not pos:
            return []
        v = self.ref(pos)
        return [self.ref(v + 4 + 4 * i) for i in range(self._unpack("<I", v))]


def _kind(name: str) -> str:
    """"native_call_addmm.out" -> "addmm" (the kernel's op); the runtime's spans ("Method::execute", and
    "OPERATOR_CALL": an instruction, its kernel call with the dispatch around it) -> "runtime"."""
    m = re.fullmatch(r"native_call_(.+?)(?:\.\w+)?", name)
    return m[1] if m else "runtime" if "::" in name or name == "OPERATOR_CALL" else name


def read(path) -> tuple[list, dict]:
    """The ETDump at `path` -> (events, meta) of a Trace: one event per ProfileEvent of every run, in file order."""
    p = Path(path)
    if not p.is_file():
        raise ForeignTraceError(p, "file", "no such file", EXPECTED)
    data = p.read_bytes()
    if len(data) >= 12 and data[8:12] == _IDENT:
        if struct.unpack_from("<I", data, 0)[0] != len(data) - 4:
            raise ForeignTraceError(path, "byte 0", f"size prefix {struct.unpack_from('<I', data, 0)[0]} but "
                                    f"{len(data) - 4} bytes follow it (truncated)", EXPECTED)
        base = 4
    elif len(data) >= 8 and data[4:8] == _IDENT:
        base = 0
    else:
        raise ForeignTraceError(path, "bytes 4-12", f"no 'ED00' file identifier (found {data[:12]!r})", EXPECTED)
    buf = _Buf(data, path)
    root = buf.ref(base)
    version = buf.scalar(root, 0, "<I", 0)
    if version != VERSION:
        raise ForeignTraceError(path, "ETDump.version", f"schema version {version}, not {VERSION}", EXPECTED)
    raws, runs, other = [], [], 0
    for r, run in enumerate(buf.tables(root, 1)):
        runs.append({"name": buf.string(run, 0), "bundled_input_index": buf.scalar(run, 1, "<i", -1)})
        for k, ev in enumerate(buf.tables(run, 3)):
            pe = buf.table(ev, 0)
            if not pe:
                other += 1  # an allocation or debug (intermediate output) event
                continue
            name = buf.string(pe, 0) or ""
            start, end = buf.scalar(pe, 6, "<Q", 0), buf.scalar(pe, 7, "<Q", 0)
            if end < start:
                raise ForeignTraceError(path, f"run_data[{r}].events[{k}]", f"{name!r} ends ({end}) before it "
                                        f"starts ({start})", EXPECTED)
            did_int, did_str = buf.scalar(pe, 3, "<i", -1), buf.string(pe, 4)
            raws.append((r, k, name, start, end, buf.scalar(pe, 1, "<i", 0), buf.scalar(pe, 2, "<i", -1),
                         did_int, did_str))
    if not raws:
        raise ForeignTraceError(path, "run_data", f"no profile event among {len(runs)} runs ({other} allocation or "
                                "debug events)", EXPECTED)
    t0 = min(x[3] for x in raws)
    events = []
    for r, k, name, start, end, chain, instr, did_int, did_str in raws:
        delegate = did_int != -1 or bool(did_str)
        e = event(name, "delegate" if delegate and not name else _kind(name), "delegate" if delegate else "cpu",
                  (start - t0) / 1e3, (end - t0) / 1e3, run=r, record=k, chain_index=chain, instruction_id=instr,
                  start_ticks=start, end_ticks=end)
        if delegate:
            e["delegate_debug_id"] = did_str if did_str else did_int
        events.append(e)
    meta = {"source": {"tool": "ExecuTorch ETDump", "format": FORMAT, "version": version}, "title": str(path),
            "measured": True, "runs": runs, "skipped_events": other,
            "time": {"unit": "runtime ticks as ns (ExecuTorch posix platform: et_pal_ticks_to_ns_multiplier 1/1; "
                     "Inspector's default source_time_scale ns); us = ticks / 1000",
                     "origin_ticks": t0, "start": "relative to the first profile event's start"}}
    return events, meta
