"""llama.cpp's Hexagon backend, per-op profile lines of a 2025 build, on stderr (the form quoted in llama.cpp issue
#18139; no upstream version printed it, so it is a local build's; upstream's of today: llamacpp_hexagon_prof):

    ggml-hex: HTP0 MUL_MAT leaf_0 4096:4096:1:1 x leaf_1 4096:64:1:1 -> q_proj 4096:64:1:1 : total 5053 us
        (quant 56 us, compute 4925 us, vtcm 68 us) cycles 10672609 pkts 5144869 (2.07) call 11 us

(one line per op; tensor names and ggml dims ne0:ne1:ne2:ne3 of each source and of the destination). The lines
carry durations, no start times: ops are laid end to end in log order, as the backend ran them one at a time.
Other stderr lines (model loading, `ggml-hex:` session messages) are skipped and counted.
"""
from __future__ import annotations

import re

from .base import ForeignTraceError, event, ggml_dims, read_text

FORMAT = "llamacpp-hexagon-op"
EXPECTED = ("llama.cpp Hexagon per-op profile lines ('ggml-hex: HTP0 OP src dims x src dims -> dst dims : total U us "
            "(quant U us, compute U us, vtcm U us) cycles C pkts P (ipc) call U us')")
_PREFIX = re.compile(r"ggml-hex: (?P<sess>\S+) (?P<op>[A-Z][A-Z0-9_+]*) (?P<rest>.*)$")
_RECORD = re.compile(r"(?P<body>.+?) : total (?P<total>\d+) us \(quant (?P<quant>\d+) us, compute (?P<compute>\d+) us, "
                     r"vtcm (?P<vtcm>\d+) us\) cycles (?P<cycles>\d+) pkts (?P<pkts>\d+) \((?P<ipc>[\d.]+)\) "
                     r"call (?P<call>\d+) us\s*$")


def sniff(text: str) -> bool:
    return any(_PREFIX.search(line) and " : total " in line for line in text.splitlines()[:5000])


def _tensor(part: str, path, n: int) -> tuple[str, list]:
    name, _, dims = part.strip().rpartition(" ")
    if not name or not re.fullmatch(r"\d+(:\d+)*", dims):
        raise ForeignTraceError(path, f"line {n}", f"tensor {part.strip()!r} is not 'name ne0:ne1:...'", EXPECTED)
    return name, ggml_dims(dims)


def read(path, version: str | None = None) -> tuple[list, dict]:
    """The log at `path` -> (events, meta) of a Trace: one npu-lane event per op (µs as printed; cycles, packets
    kept per event)."""
    text = read_text(path, EXPECTED)
    events, skipped, newer, t = [], 0, 0, 0.0
    for n, line in enumerate(text.splitlines(), 1):
        m = _PREFIX.search(line)
        if m is None:
            skipped += 1  # other stderr output: loader, sampler, the shell
            newer += "profile-op " in line
            continue
        r = _RECORD.match(m["rest"])
        if r is None:
            raise ForeignTraceError(path, f"line {n}", f"{m['op']} record truncated or unknown: "
                                    f"{line.strip()[:80]!r}", EXPECTED)
        srcs_text, arrow, dst_text = r["body"].partition(" -> ")
        if not arrow:
            raise ForeignTraceError(path, f"line {n}", "no '->' between sources and destination", EXPECTED)
        srcs = [_tensor(s, path, n) for s in srcs_text.split(" x ")]
        dst, dst_shape = _tensor(dst_text, path, n)
        total, compute, cycles = int(r["total"]), int(r["compute"]), int(r["cycles"])
        e = event(dst, m["op"], "npu", t, t + total, session=m["sess"], line=n, inputs=[s for s, _ in srcs],
                  input_shapes=[d for _, d in srcs], output=dst, shape=dst_shape, quant_us=int(r["quant"]),
                  compute_us=compute, vtcm_us=int(r["vtcm"]), call_us=int(r["call"]), cycles=cycles,
                  packets=int(r["pkts"]), mhz=cycles / compute if compute else None)
        if m["op"] == "MUL_MAT" and len(srcs) == 2:
            (k, n_out, *_), (_, rows, *_) = srcs[0][1] + [1, 1], srcs[1][1] + [1, 1]
            e["flops"] = 2 * k * n_out * rows
        events.append(e)
        t += total
    if not events:
        hint = (f" ({newer} newer 'profile-op' lines: read them with --format llamacpp-hexagon-profile-op)" if newer
                else "")
        raise ForeignTraceError(path, "whole file", f"no per-op profile line among {skipped} lines{hint}", EXPECTED)
    meta = {"source": {"tool": "llama.cpp ggml-hexagon", "format": FORMAT, "version": version},
            "title": f"{path}", "measured": True, "skipped_lines": skipped, "newer_profile_op_lines": newer,
            "time": {"unit": "us as printed (total per op)", "start": "ops laid end to end in log order: the lines "
                     "carry no start time", "cycles": "kept per event; the line states no clock: mhz per event is "
                     "cycles / compute us (implied, not stated)"}}
    return events, meta
