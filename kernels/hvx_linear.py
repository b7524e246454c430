"""The npu lane's linear records on the hvx backend: what linear_records computes, run as Hexagon code.

`runner(rec, part, get, cols)` -> linear(x: float32[M, K], counters=None, dsp_counts=None) -> float32[M, N], or
None when the record (or part) is not NPU work (the caller then runs the numba runner). As with linear_records'
runners, `counters` is the calling run's (outliers, cold rows read); `dsp_counts` (a dict, per call) receives
QEMU's counts for the call: packets, insns, hvx_insns, scalar_packets (hvx_bridge.dsp_estimate).

    w8a8, smoothquant, w8a8-shadow's int8 part   quantize, vrmpy GEMM, requantize on the DSP: bit-exact
    w8a8-shadow (part all)                       the int8 GEMM on the DSP + the sparse float shadow GEMM on the
                                                 CPU, as mllm-NPU §3.3 splits it (the shadow part is CPU work)
    q4_0-tile                                    super-blocks dequantized once through vlut16, then the FP16
                                                 GEMM on the Hexagon scalar core per call, summed over k in
                                                 order as the numba npu lane does (kernels/f16_gemm.py): exact
"""
from __future__ import annotations

import numpy as np

from . import hvx_bridge
from .linear_records import scheme_of, shadow_delta
from .tiles import from_tiles

HVX_SCHEMES = {"w8a8", "w8a8-shadow", "smoothquant", "q4_0-tile"}  # the npu lane's record schemes (NPU_KINDS)
EXACT_SCHEMES = HVX_SCHEMES                                          # bit-identical with the numba backend


def _w8a8(rec, get, cols=None, smooth=None, dsp=None):
    dsp = dsp or hvx_bridge.shared()
    wt, sa, sw = get(rec["wt"]), rec["scale_a"], rec["scale_w"]
    if cols is not None:  # a HeteroLLM row cut: this lane's output channels only
        wt = np.ascontiguousarray(wt[:, cols[0]:cols[1]])
    key = ("w8a8", rec["wt"], cols)
    return lambda x, counters=None, dsp_counts=None: dsp.w8a8(np.ascontiguousarray(x, np.float32), wt, sa, sw,
                                                              smooth, key=key, counters=dsp_counts)


def _q4_0_tile(rec, get, dsp=None):
    dsp = dsp or hvx_bridge.shared()
    N, K = rec["shape"]
    w16 = from_tiles(dsp.q4_tile_dequant(get(rec["blocks"])), N, K)  # vlut16 on the DSP; tile order -> [N, K]
    key = ("f16w", rec["blocks"])
    return lambda x, counters=None, dsp_counts=None: dsp.gemm_f16w(np.ascontiguousarray(x, np.float32), w16, key=key,
                                                                   counters=dsp_counts)


def runner(rec: dict, part: str, get, cols=None, dsp=None):
    """The hvx runner of a linear record (part "all" | "int8" | "shadow"), or None when it is not NPU work."""
    scheme = scheme_of(rec)
    if part == "shadow" or scheme not in HVX_SCHEMES:
        return None
    if part == "int8" or scheme == "w8a8":
        return _w8a8(rec, get, cols, dsp=dsp)
    if scheme == "smoothquant":
        return _w8a8(rec, get, smooth=np.asarray(get(rec["smooth"]), np.float32), dsp=dsp)
    if scheme == "w8a8-shadow":
        base = _w8a8(rec, get, dsp=dsp)
        if not rec["shadow"]:
            return base
        delta = shadow_delta(rec, get, None)  # the CPU half: counts into the caller's counters, per call
        return lambda x, counters=None, dsp_counts=None: (base(x, counters, dsp_counts)
                                                          + delta(x, {} if counters is None else counters))
    return _q4_0_tile(rec, get, dsp=dsp)
