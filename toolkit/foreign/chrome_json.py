"""Chrome trace-event JSON (Perfetto's legacy JSON, chrome://tracing): what mllm, the Hexagon SDK's itrace and many
exporters write. Complete events ("ph": "X", ts and dur in µs) and begin/end pairs ("B"/"E") become events; metadata
("M") names the threads, which say the lane (HMX, HVX/NPU/DSP, GPU, CPU, DMA); other events (counters, instants,
flows) are skipped and counted. Tensor roles, ggml shapes ("2048:8192 x 2048:2") and dtypes in args are kept.
"""
from __future__ import annotations

import json
import re

from .base import CHROME_KEY, ForeignTraceError, event, ggml_dims, ggml_layer, read_text

FORMAT = "chrome-json"
EXPECTED = "Chrome trace-event JSON ({\"traceEvents\": [...]} or a list of events with ph, ts (µs), dur)"
_LANES = (("hmx", "hmx"), ("dma", "dma"), ("hvx", "npu"), ("npu", "npu"), ("htp", "npu"), ("dsp", "npu"),
          ("hexagon", "npu"), ("gpu", "gpu"), ("adreno", "gpu"), ("opencl", "gpu"), ("cpu", "cpu"))


def sniff(text: str) -> bool:
    head = text.lstrip()[:4096]
    return head.startswith(("{", "[")) and ('"traceEvents"' in head or '"ph"' in head)


def lane_of(label: str) -> str | None:
    """The lane a thread or process name says ("HVX matmul/attn" -> npu, "HMX (matrix)" -> hmx), else None."""
    low = label.lower()
    return next((lane for key, lane in _LANES if key in low), None)


_layer = ggml_layer


def _shapes(text) -> list | None:
    if not isinstance(text, str) or not re.fullmatch(r"\d+(:\d+)*( x \d+(:\d+)*)*", text.strip()):
        return None
    return [ggml_dims(p) for p in text.split(" x ")]


def records_and_names(path, raw: list, where: str, expected: str) -> tuple[dict, dict]:
    """Check that every trace-event record is a map with a phase 'ph' (else a one-line error naming where[i]) ->
    (thread names by (pid, tid), process names by pid) from the metadata records ("M")."""
    bad = next((i for i, r in enumerate(raw) if not isinstance(r, dict) or "ph" not in r), None)
    if bad is not None:
        raise ForeignTraceError(path, f"{where}[{bad}]", f"a record without 'ph': {json.dumps(raw[bad])[:60]}",
                                expected)
    threads, procs = {}, {}
    for r in raw:
        if r["ph"] == "M" and r.get("name") == "thread_name":
            threads[(r.get("pid"), r.get("tid"))] = str(r.get("args", {}).get("name", ""))
        elif r["ph"] == "M" and r.get("name") == "process_name":
            procs[r.get("pid")] = str(r.get("args", {}).get("name", ""))
    return threads, procs


def read(path) -> tuple[list, dict]:
    """The JSON at `path` -> (events, meta) of a Trace: one event per complete or begin/end-paired event, lanes
    from thread names."""
    text = read_text(path, EXPECTED)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ForeignTraceError(path, f"line {e.lineno} column {e.colno}", f"not JSON ({e.msg})", EXPECTED) from None
    if isinstance(doc, dict) and ({"events", "meta"} <= set(doc) and "traceEvents" not in doc
                                  or isinstance(doc.get("otherData"), dict) and CHROME_KEY in doc["otherData"]):
        # edgeprobe's own trace (emulated or predicted times): importing it would mark those times measured
        raise ForeignTraceError(path, "document", "a trace edgeprobe wrote (open it with `edgeprobe trace show` or "
                                "Trace.load)", EXPECTED + " recorded by another tool")
    raw = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(raw, list) or not raw:
        what = f"top-level keys {sorted(doc)[:6]}" if isinstance(doc, dict) else f"a {type(doc).__name__}"
        raise ForeignTraceError(path, "document", f"{what}: no list of trace events with 'ph'", EXPECTED)
    threads, procs = records_and_names(path, raw, "traceEvents" if isinstance(doc, dict) else "document", EXPECTED)
    events, skipped, open_ = [], 0, {}
    for i, r in enumerate(raw):
        ph = r["ph"]
        if ph == "M":
            continue
        if ph not in ("X", "B", "E"):
            skipped += 1
            continue
        ts = r.get("ts")
        if not isinstance(ts, (int, float)) or (ph == "X" and not isinstance(r.get("dur"), (int, float))):
            raise ForeignTraceError(path, f"traceEvents[{i}]", f"a '{ph}' event without numeric ts"
                                    + (" and dur" if ph == "X" else ""), EXPECTED)
        key = (r.get("pid"), r.get("tid"))
        if ph == "B":
            open_.setdefault(key, []).append(r)
            continue
        if ph == "E":
            if not open_.get(key):
                raise ForeignTraceError(path, f"traceEvents[{i}]", "an 'E' event without its 'B'", EXPECTED)
            b = open_[key].pop()
            r, start, end = {**b, "args": {**b.get("args", {}), **r.get("args", {})}}, b["ts"], ts
        else:
            start, end = ts, ts + r["dur"]
        thread = threads.get(key, "")
        lane = lane_of(thread) or lane_of(procs.get(r.get("pid"), "")) or (thread.lower() or "cpu")
        args = r.get("args", {}) if isinstance(r.get("args"), dict) else {}
        name = str(r.get("name", ""))
        kind = str(args.get("op") or (name.split() or ["?"])[0])
        e = event(name, kind, lane, start, end, _layer(args.get("layer"), name, args.get("role")), record=i,
                  thread=thread)
        if args.get("role"):
            e["tensors"] = args["role"]
        shapes = _shapes(args.get("shape"))
        if shapes:
            e["input_shapes"] = shapes
        if isinstance(args.get("dtype"), str):
            e["dtypes"] = args["dtype"].split(" x ")
        for k in ("kernel", "usec", "cycles"):
            if k in args:
                e[k] = args[k]
        if isinstance(args.get("cycles"), (int, float)) and args.get("usec"):
            e["mhz"] = args["cycles"] / args["usec"]  # implied by the event's own cycles and µs
        events.append(e)
    unclosed = sum(len(v) for v in open_.values())
    if not events:
        raise ForeignTraceError(path, "traceEvents", f"no complete ('X') or begin/end events among {len(raw)}",
                                EXPECTED)
    other = doc.get("otherData", {}) if isinstance(doc, dict) else {}
    meta = {"source": {"tool": next(iter(procs.values()), "") or "chrome trace", "format": FORMAT,
                       "version": other.get("version") if isinstance(other, dict) else None},
            "title": next(iter(procs.values()), str(path)), "measured": True, "skipped_events": skipped,
            "unclosed_begin_events": unclosed, "threads": {f"{p}/{t}": n for (p, t), n in threads.items()},
            "time": {"unit": "us (Chrome trace ts/dur)", "cycles": "kept per event where args give them; mhz per "
                     "event is args.cycles / args.usec (implied)"}}
    return events, meta
