"""llama.cpp's Hexagon backend, profile output of today (GGML_HEXAGON_PROFILE=1|2|3, printed at debug verbosity).

Specified by the format strings of `ggml/src/ggml-hexagon/ggml-hexagon.cpp` (`ggml_hexagon_dump_op_prof`,
`ggml_hexagon_dump_batch_prof`, `ggml_hexagon_dump_trace_events`; ggml d99724f2, synced from llama.cpp d3cf1f14,
unchanged since llama.cpp PR #26049 of 2026-07-23):

    ggml-hex: %s profile-op OPBATCH|----|n-ops %u|%s|----|----|usec %u cycles %llu start %llu mhz %.1f
    ggml-hex: %s profile-op %s|%s|%s|%s|%s|%s|usec %u cycles %u start %u mhz %.1f%s
    ggml-hex: %s trace-evt %s: thread %u info %u %s %u

A finished batch prints its OPBATCH line (n-ops, at level 3 `evt-cnt` per thread; its 64-bit start cycle), then one
line per op — session, op (fused ops joined by `+`), then `|`-separated names, dims (ne0:ne1[:ne2:ne3]), types and
strides, each listing the inputs joined by " x ", then " -> " and the output; the kernel's parameters (`hmx-tiled vtcm
N`, `----`); usec, cycles, the low 32 bits of its start cycle, mhz; at level 2 a ` pmu [8 counters]` tail — and at
level 3 that batch's trace events (thread 0-9 HVX, 10 HMX; start and stop cycles, low 32 bits). Lines may carry a
log timestamp before `ggml-hex:`; other stderr lines are skipped and counted.

Events: one per op on the npu lane at its own start (cycles unwrapped against its batch's 64-bit start, over the
line's mhz), grouped by batch; trace events as intervals on `hvx` and `hmx`, paired start to stop.
"""
from __future__ import annotations

import re

from .base import ForeignTraceError, event, ggml_dims, ggml_layer, read_text

FORMAT = "llamacpp-hexagon-profile-op"
EXPECTED = ("llama.cpp Hexagon profile lines of ggml-hexagon.cpp's ggml_hexagon_dump_op_prof: 'ggml-hex: SESS "
            "profile-op OP|names|dims|types|strides|params|usec U cycles C start S mhz M[ pmu [..]]', its 'profile-op "
            "OPBATCH|----|n-ops N|...' lines and 'trace-evt' lines")
_LINE = re.compile(r"ggml-hex: (?P<sess>\S+) (?P<what>profile-op|trace-evt) (?P<rest>.*)$")
_OP = re.compile(r"(?P<op>[^|]+)\|(?P<names>[^|]*)\|(?P<dims>[^|]*)\|(?P<types>[^|]*)\|(?P<strides>[^|]*)\|"
                 r"(?P<params>[^|]*)\|usec (?P<usec>\d+) cycles (?P<cycles>\d+) start (?P<start>\d+) "
                 r"mhz (?P<mhz>\d+(?:\.\d+)?)(?: pmu \[(?P<pmu>\d+(?:,\d+){7})\])?\s*$")
_BATCH = re.compile(r"n-ops (?P<n>\d+)$")
_EVT = re.compile(r"(?P<name>[A-Za-z0-9_]+): thread (?P<thread>\d+) info (?P<info>\d+) (?P<edge>start|stop) "
                  r"(?P<cycles>\d+)\s*$")
HMX_THREAD = 10  # the trace's thread 10 is the HMX queue; 0-9 the HVX threads
WRAP = 1 << 32


def sniff(text: str) -> bool:
    return any("profile-op " in line and "|usec " in line for line in text.splitlines()[:5000])


def _sides(text: str, path, n: int, what: str) -> tuple[list[str], str]:
    """"a x b -> c" -> (["a", "b"], "c"); an op without inputs prints its output alone."""
    srcs, arrow, dst = text.partition(" -> ")
    if not arrow:
        return [], text.strip()
    return [s.strip() for s in srcs.split(" x ")], dst.strip()


def _dims(part: str, path, n: int) -> list:
    if part == "NONE":
        return []
    if not re.fullmatch(r"\d+(:\d+)*", part):
        raise ForeignTraceError(path, f"line {n}", f"dims {part!r} are not ne0:ne1[:ne2:ne3]", EXPECTED)
    return ggml_dims(part)


def _unwrap(low: int, base: int) -> int:
    """A 32-bit cycle count read as the first 64-bit one at or after `base` (its batch's start)."""
    full = (base & ~(WRAP - 1)) | low
    return full + WRAP if full < base else full


def read(path, version: str | None = None) -> tuple[list, dict]:
    text = read_text(path, EXPECTED)
    events, batches, traces, open_evt = [], [], [], {}
    skipped, batch, expected_ops, t0 = 0, None, 0, None
    for n, line in enumerate(text.splitlines(), 1):
        m = _LINE.search(line)
        if m is None:
            skipped += 1  # other stderr output: loader, sampler, the backend's other debug lines
            continue
        if m["what"] == "trace-evt":
            e = _EVT.match(m["rest"])
            if e is None:
                raise ForeignTraceError(path, f"line {n}", f"trace-evt record unknown: {line.strip()[:80]!r}", EXPECTED)
            if batch is None:
                raise ForeignTraceError(path, f"line {n}", "a trace-evt line before any OPBATCH line", EXPECTED)
            key = (batch["index"], int(e["thread"]), e["name"], int(e["info"]))
            cyc = _unwrap(int(e["cycles"]), batch["start_cycles"])
            if e["edge"] == "start":
                open_evt[key] = (cyc, n)
            elif key in open_evt:
                traces.append((key, open_evt.pop(key), cyc, batch))
            continue
        r = _OP.match(m["rest"])
        if r is None:
            raise ForeignTraceError(path, f"line {n}", f"profile-op record truncated or unknown: "
                                    f"{line.strip()[:80]!r}", EXPECTED)
        mhz, usec, cycles = float(r["mhz"]), int(r["usec"]), int(r["cycles"])
        if r["op"] == "OPBATCH":
            b = _BATCH.match(r["dims"])
            if b is None:
                raise ForeignTraceError(path, f"line {n}", f"OPBATCH without 'n-ops N': {r['dims']!r}", EXPECTED)
            if batch is not None and expected_ops:
                raise ForeignTraceError(path, f"line {n}", f"batch {batch['index']} announced {batch['n_ops']} ops "
                                        f"and {batch['n_ops'] - expected_ops} followed", EXPECTED)
            batch = {"index": len(batches), "line": n, "session": m["sess"], "n_ops": int(b["n"]), "usec": usec,
                     "cycles": cycles, "start_cycles": int(r["start"]), "mhz": mhz,
                     "evt_cnt": [int(x) for x in r["types"][len("evt-cnt "):].split(",")]
                     if r["types"].startswith("evt-cnt ") else None}
            batches.append(batch)
            expected_ops = batch["n_ops"]
            if t0 is None:
                t0 = (batch["start_cycles"], mhz)
            continue
        if batch is None or expected_ops == 0:
            raise ForeignTraceError(path, f"line {n}", "a profile-op line outside a batch (no OPBATCH line "
                                    "announced it)", EXPECTED)
        expected_ops -= 1
        inputs, output = _sides(r["names"], path, n, "names")
        dim_in, dim_out = _sides(r["dims"], path, n, "dims")
        types_in, type_out = _sides(r["types"], path, n, "types")
        clock = mhz or batch["mhz"]
        start_cyc = _unwrap(int(r["start"]), batch["start_cycles"])
        start_us = (start_cyc - t0[0]) / clock if clock else 0.0
        e = event(output, r["op"], "npu", start_us, start_us + usec, ggml_layer(output, *inputs), session=m["sess"],
                  line=n, inputs=inputs,
                  input_shapes=[_dims(d, path, n) for d in dim_in], output=output, shape=_dims(dim_out, path, n),
                  dtypes=types_in + [type_out], strides=r["strides"], kernel=r["params"].strip(), cycles=cycles,
                  mhz=mhz, batch=batch["index"], group=f"batch{batch['index']}",
                  **({"pmu": [int(x) for x in r["pmu"].split(",")]} if r["pmu"] else {}))
        shapes = e["input_shapes"]
        if r["op"].startswith("MUL_MAT") and len(shapes) >= 2 and shapes[0] and shapes[1]:
            (k, n_out, *_), (_, rows, *_) = shapes[0] + [1, 1], shapes[1] + [1, 1]
            e["flops"] = 2 * k * n_out * rows
        events.append(e)
    if batch is not None and expected_ops:
        raise ForeignTraceError(path, "end of file", f"batch {batch['index']} announced {batch['n_ops']} ops and "
                                f"{batch['n_ops'] - expected_ops} followed (a cut log?)", EXPECTED)
    if not events:
        raise ForeignTraceError(path, "whole file", f"no profile-op line of an op among {skipped} lines", EXPECTED)
    for (b, thread, name, info), (c0, line), c1, bt in traces:
        clock = bt["mhz"]
        lane = "hmx" if thread == HMX_THREAD else "hvx"
        events.append(event(f"{name}#{info}", name, lane, (c0 - t0[0]) / clock, (c1 - t0[0]) / clock, line=line,
                            thread=thread, info=info, batch=b, group=f"batch{b}"))
    meta = {"source": {"tool": "llama.cpp ggml-hexagon", "format": FORMAT, "version": version},
            "title": f"{path}", "measured": True, "skipped_lines": skipped, "batches": batches,
            "unpaired_trace_events": len(open_evt),
            "time": {"unit": "us: cycles over the line's mhz (cycles / usec as printed)",
                     "start": "each op's start cycle, unwrapped against its batch's 64-bit start; 0 = the first batch",
                     "trace": "trace-evt start/stop cycles over their batch's mhz"}}
    return events, meta
