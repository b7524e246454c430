"""Qualcomm QNN / QAIRT HTP optrace: the Chrome-trace JSON that `qnn-profile-viewer` writes with the optrace reader
(`--reader libQnnHtpOptraceProfilingReader.so --schematic <model>_schematic.bin`) from a run profiled with
`--profiling_level detailed --profiling_option optrace`:

    {"header": {"header_version": {...}, "version": {"major": 1, "minor": 1, ...}, "artifact_type": "OP_TRACE"},
     "traceEvents": [{"name": "q::ConvLayer_s1.opt", "ph": "X", "tid": 256, "pid": 0, "ts": 40057, "dur": 4095,
       "args": {"ID": "0x000011ed00000012", "HTP Op Type": "q::ConvLayer_s1.opt", "Dims": [1,8,32,256],
                "Data Type": "QUInt8", "Flags": ["uses_hmx"], "QNN Op Type": "FullyConnected", "QNN Op Name":
                "MatMul_0", "Start Cycle": 7997466106711, "Duration (cycles)": 4095, "Dominant Path Cycles": 4095}},
      ...]}

One event per HTP op (the QNN op it implements in args), on its hardware thread: tid 256 "Type: HMX", 512.. "Type:
HVX". `ts` and `dur` are HTP cycles, not the µs Chrome JSON means. Process "Core N Overview" holds each op once; the
other processes (one per QNN op, "QNN::MatMul_0") repeat the same events and are skipped, as are the ops without a
Start Cycle (tid 1 "Non Executed Tensors": constants and views, a nominal dur), flows and counters; all counted.
The clock is the one qnn-profile-viewer states in the `<name>_runtrace.json` it writes beside the optrace:
`summary_htp_frequency_ghz` of the "Graph Execute" whose stat cycles hold the ops' first Start Cycle (or the caller's
`mhz` where that file is absent).

FLOPs, from the shapes the file gives (no default shape is assumed): the compute op of a FullyConnected / MatMul /
Conv2d (two inputs or more, no DMA flag) does 2 x (its output elements) x K. K, the reduced dimension, is the last
dim of its input in[0] (FullyConnected, MatMul: rows M, the leading dims, kept from input to output) or, from the
weight in[1] (the op named in "Inputs Ops"), prod(weight dims) / (output channels) (Conv2d: kh*kw*cin; for a
FullyConnected it must equal in[0]'s K). Ops of another kind do no arithmetic that is priced here: flops 0, and
`bytes` = their own tensor's bytes (Dims x Data Type) where both are given. A compute op whose shapes are not in the
file (an excerpt, a view) keeps no flops; meta["flops"] counts each case.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .base import ForeignTraceError, event, read_text
from .chrome_json import lane_of, records_and_names

FORMAT = "qnn-optrace"
EXPECTED = ("QNN HTP optrace JSON from qnn-profile-viewer's optrace reader ({\"header\": {\"artifact_type\": "
            "\"OP_TRACE\"}, \"traceEvents\": [...]}, ts/dur in HTP cycles) with its <name>_runtrace.json beside it")
_ARTIFACT = re.compile(r'"artifact_type"\s*:\s*"(OP_TRACE|RUN_TRACE|QHAS)"')
_OVERVIEW = re.compile(r"Core (\d+) Overview")
_LAYER = re.compile(r"(?:\blayers?|blk)[._/](\d+)")
# what an op's Flags say of the unit it ran on; the first match wins (an HMX op also waits on DMA)
_FLAG_LANES = (("uses_hmx", "hmx"), ("dma", "dma"), ("uses_hvx", "npu"))
_MATMUL_KINDS = ("FullyConnected", "MatMul")  # QNN op types whose K is in[0]'s last dim
_COMPUTE_KINDS = (*_MATMUL_KINDS, "Conv2d")
_BITS = re.compile(r"(\d+)$")  # QNN data types end in their width: QUInt8, Int32, Float16


def sniff(text: str) -> bool:
    head = text.lstrip()[:2048]
    return head.startswith("{") and _ARTIFACT.search(head) is not None


def runtrace_path(path) -> Path:
    """Where qnn-profile-viewer writes the run trace of an optrace: chrometrace.json -> chrometrace_runtrace.json."""
    p = Path(path)
    return p.with_name(f"{p.stem}_runtrace{p.suffix}")


def _load(path, expected: str):
    text = read_text(path, expected)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ForeignTraceError(path, f"line {e.lineno} column {e.colno}", f"not JSON ({e.msg})", expected) from None


def clock_ghz(path, first_cycle: int) -> tuple[float, str]:
    """The HTP clock (GHz) of the Graph Execute in the run trace at `path` whose stat cycles hold `first_cycle`, and
    where it was read."""
    expected = "a QNN run trace (artifact_type RUN_TRACE) with Graph Execute events"
    doc = _load(path, expected)
    raw = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(raw, list):
        raise ForeignTraceError(path, "document", "no traceEvents list", expected)
    runs = [(i, r.get("args", {})) for i, r in enumerate(raw)
            if isinstance(r, dict) and r.get("name") == "Graph Execute" and r.get("ph") == "X"]
    for i, a in runs:
        lo, hi, ghz = a.get("stat_start_cycles"), a.get("stat_end_cycles"), a.get("summary_htp_frequency_ghz")
        if isinstance(lo, int) and isinstance(hi, int) and lo <= first_cycle <= hi:
            if not isinstance(ghz, (int, float)) or ghz <= 0:
                raise ForeignTraceError(path, f"traceEvents[{i}]", f"summary_htp_frequency_ghz {ghz!r}", expected)
            return float(ghz), (f"{Path(path).name} traceEvents[{i}] Graph Execute: summary_htp_frequency_ghz {ghz} "
                                f"(stat cycles {lo}..{hi} hold the ops' first Start Cycle {first_cycle})")
    raise ForeignTraceError(path, "Graph Execute events", f"none of {len(runs)} holds the optrace's first Start Cycle "
                            f"{first_cycle} (the run trace of another run?)", expected)


def _layer(name: str) -> int:
    m = _LAYER.search(name)
    return int(m[1]) if m else -1


def _lane(flags: list, thread: str) -> str:
    for flag, lane in _FLAG_LANES:
        if any(str(f).startswith(flag) for f in flags):
            return lane
    return lane_of(thread) or "npu"


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _dims(v) -> list | None:
    return [int(d) for d in v] if isinstance(v, list) and v and all(isinstance(d, int) and d > 0 for d in v) else None


def _tensor_bytes(a: dict) -> int | None:
    """An op's own tensor size in bytes from its Dims and Data Type, None where either is missing."""
    dims, m = _dims(a.get("Dims")), _BITS.search(str(a.get("Data Type") or ""))
    return _prod(dims) * int(m[1]) // 8 if dims and m and int(m[1]) % 8 == 0 else None


def _is_compute(kind: str, a: dict, flags: list) -> bool:
    """The op that does a FullyConnected / MatMul / Conv2d's arithmetic: two operands at least, not a DMA of it."""
    return (kind in _COMPUTE_KINDS and len(a.get("Inputs Ops") or []) >= 2
            and not any(str(f).startswith("dma") for f in flags))


def _flops(kind: str, a: dict, shapes: dict) -> tuple[dict | None, str]:
    """2 * output elements * K of a compute op ({flops, reduced_dim, rows, flops_from}), or None and why not.
    shapes: op ID -> Dims of every record of the file that states them."""
    out = _dims(a.get("Dims"))
    if out is None:
        return None, "no Dims of its own"
    ins = list(a.get("Inputs Ops") or [])
    x, w = shapes.get(ins[0]), shapes.get(ins[1])
    n, rows = out[-1], _prod(out[:-1])
    k_w = _prod(w) // n if w and _prod(w) % n == 0 else None
    if kind in _MATMUL_KINDS:
        if x is None:
            return None, f"input {ins[0]} not in the file"
        if _prod(x[:-1]) != rows:
            return None, f"input {ins[0]} dims {x} keep no rows of the output's {out}"
        k = x[-1]
        if w is not None and k_w != k and kind == "FullyConnected":
            return None, f"weight {ins[1]} dims {w} disagree with K {k} from input {ins[0]} dims {x}"
        if w is not None and kind == "MatMul" and k not in w[-2:]:
            return None, f"second input {ins[1]} dims {w} hold no K {k} of input {ins[0]} dims {x}"
        how = f"K = {k}: last dim of input {ins[0]} {x}" + (f", = weight {ins[1]} {w} / {n}" if k_w == k else "")
    else:
        if k_w is None:
            return None, f"weight {ins[1]} " + ("not in the file" if w is None else f"dims {w} not a multiple of {n}")
        k = k_w
        how = f"K = {k}: weight {ins[1]} {w} / {n} output channels"
    return {"flops": 2 * _prod(out) * k, "reduced_dim": k, "rows": rows, "flops_from": how}, ""


def read(path, mhz: float | None = None) -> tuple[list, dict]:
    """The optrace at `path` -> (events, meta) of a Trace: one event per executed HTP op of the Core Overview, µs =
    cycles / the clock (`mhz`, else the Graph Execute clock of the run trace beside the file)."""
    path = Path(path)
    doc = _load(path, EXPECTED)
    head = doc.get("header") if isinstance(doc, dict) else None
    kind = head.get("artifact_type") if isinstance(head, dict) else None
    if kind in ("RUN_TRACE", "QHAS"):
        raise ForeignTraceError(path, "header", f"a QNN {kind} artifact, not the per-op trace: import the optrace "
                                "(artifact_type OP_TRACE) qnn-profile-viewer wrote beside it", EXPECTED)
    if kind != "OP_TRACE":
        raise ForeignTraceError(path, "header", f"artifact_type {kind!r}", EXPECTED)
    raw = doc.get("traceEvents")
    if not isinstance(raw, list) or not raw:
        raise ForeignTraceError(path, "document", "no list of trace events", EXPECTED)
    threads, procs = records_and_names(path, raw, "traceEvents", EXPECTED)
    cores = {pid: int(m[1]) for pid, name in procs.items() if (m := _OVERVIEW.fullmatch(name))}
    if not cores:
        if 0 in procs:
            raise ForeignTraceError(path, "process_name", f"no 'Core N Overview' process among {len(procs)}", EXPECTED)
        cores = {0: 0}  # an excerpt without process names: pid 0 is the overview qnn-profile-viewer writes first
    ops, skipped = [], {"per_qnn_op_copies": 0, "not_executed": 0, "flows_counters_other": 0}
    for i, r in enumerate(raw):
        if r["ph"] == "M":
            continue
        args = r.get("args") if isinstance(r.get("args"), dict) else {}
        if r["ph"] != "X":
            skipped["flows_counters_other"] += 1
        elif r.get("pid") not in cores:
            skipped["per_qnn_op_copies"] += 1
        elif "Start Cycle" not in args:
            skipped["not_executed"] += 1
        else:
            ts, dur = r.get("ts"), r.get("dur")
            if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)) or dur < 0:
                raise ForeignTraceError(path, f"traceEvents[{i}]", f"op {r.get('name')!r} with ts {ts!r} dur {dur!r}",
                                        EXPECTED)
            ops.append((i, r, args))
    if not ops:
        raise ForeignTraceError(path, "traceEvents", f"no executed HTP op among {len(raw)} records", EXPECTED)
    first = min(int(a["Start Cycle"]) for _, _, a in ops)
    rt = runtrace_path(path)
    if mhz is not None:
        if not isinstance(mhz, (int, float)) or not mhz > 0:
            raise ForeignTraceError(path, "clock", f"mhz {mhz!r}", "a positive HTP clock in MHz")
        ghz, where = mhz / 1e3, "given by the caller"
        if rt.is_file():  # two clocks for one run: they must agree (0.1%: a clock typed to four digits)
            stated, at = clock_ghz(rt, first)
            if abs(stated - ghz) > 1e-3 * stated:
                raise ForeignTraceError(path, "clock", f"mhz {mhz} given, but {at}; drop mhz or pass "
                                        f"{stated * 1e3:g}", EXPECTED)
            where += f" (agrees with {at})"
    else:
        if not rt.is_file():
            raise ForeignTraceError(path, "clock", f"ts/dur are HTP cycles and the file states no clock: {rt.name} "
                                    "(written beside it by qnn-profile-viewer) not found; pass mhz (--mhz)", EXPECTED)
        ghz, where = clock_ghz(rt, first)
    shapes = {a["ID"]: d for r in raw if isinstance(a := r.get("args"), dict) and "ID" in a
              and (d := _dims(a.get("Dims"))) is not None}
    counted = {"compute_ops": 0, "compute_ops_without_shapes": 0, "other_ops_flops_0": 0, "other_ops_with_bytes": 0}
    unread = []
    per_us = ghz * 1e3  # cycles per µs
    events = []
    for i, r, a in ops:
        pid, tid = r.get("pid"), r.get("tid")
        thread = threads.get((pid, tid), "")
        flags = list(a.get("Flags") or [])
        qnn_name = str(a.get("QNN Op Name", r.get("name", "")))
        e = event(qnn_name, str(a.get("QNN Op Type", r.get("name", ""))), _lane(flags, thread), r["ts"] / per_us,
                  (r["ts"] + r["dur"]) / per_us, _layer(qnn_name), record=i, kernel=str(r.get("name", "")),
                  htp_op=a.get("HTP Op Type"), op_id=a.get("ID"), flags=flags, thread=thread, tid=tid,
                  core=cores[pid], cycles=int(r["dur"]), start_cycle=int(a["Start Cycle"]),
                  dominant_path_cycles=a.get("Dominant Path Cycles"), cycles_per_packet=a.get("Cycles per Packet"),
                  input_ops=list(a.get("Inputs Ops") or []), mhz=per_us)
        if a.get("Dims"):
            e["shape"] = list(a["Dims"])
        if a.get("Data Type"):
            e["dtype"] = a["Data Type"]
        if _is_compute(e["kind"], a, flags):
            counted["compute_ops"] += 1
            got, why = _flops(e["kind"], a, shapes)
            if got is None:
                counted["compute_ops_without_shapes"] += 1
                unread.append(f"traceEvents[{i}] {qnn_name} ({r.get('name')}): {why}")
            else:
                e.update(got)
        else:
            e["flops"] = 0
            counted["other_ops_flops_0"] += 1
            nbytes = _tensor_bytes(a)
            if nbytes is not None:
                e["bytes"] = nbytes
                counted["other_ops_with_bytes"] += 1
        events.append(e)
    events.sort(key=lambda e: (e["start_us"], e["record"]))
    v = head.get("version") or {}
    meta = {"source": {"tool": "qnn-profile-viewer (QNN HTP optrace reader)", "format": FORMAT,
                       "version": f"OP_TRACE {v.get('major')}.{v.get('minor')}.{v.get('patch')}"},
            "title": f"{path}", "measured": True, "skipped_events": sum(skipped.values()), "skipped": skipped,
            "threads": {f"{p}/{t}": n for (p, t), n in threads.items() if p in cores},
            "time": {"unit": "HTP cycles (ts, dur) / clock -> us", "clock_mhz": per_us, "clock_from": where,
                     "start": "ts: cycles from the optrace's own origin (Start Cycle - ts)"},
            "flops": {**counted, "without_shapes": unread,
                      "rule": "compute ops (FullyConnected/MatMul/Conv2d, 2+ inputs, no DMA flag): 2 x output "
                              "elements x K from the shapes in the file; other ops 0, bytes = Dims x Data Type"}}
    return events, meta
