"""Runners of quantized-linear records: manifest record + blobs -> linear(x), as the device computes it.

A record is the JSON a scheme's builder (`edgeprobe.quant.schemes`) writes into a QuantizedModel's
manifest; its field `scheme` names the recipe (w8a8, q4_0-tile, ...; `scheme_of` also reads the `kind` of
records saved before the field was renamed). Its blobs are raw arrays named by sha256. The host simulation and
the device agent run the same functions from here, so they compute the same thing. Each `run_<scheme>(rec, get,
counters)` takes `get(sha) -> array` and a counters dict (events such as outliers and cold rows read), and
returns linear(x: float32[M, K], counters=<that dict>) -> float32[M, N]. A caller that keeps one runner
across many runs (the agent) passes each call's own counters, so every run counts only its own events.
"""
from __future__ import annotations

import numpy as np

from . import f16_gemm, int8_gemm
from .f16_gemm import gemm_f16w_seq
from .int8_gemm import (
    GEMV_M,
    gemm_codes_f32,
    gemm_s8s32,
    linear_w8a8_gemv,
    quantize_per_tensor,
    quantize_per_tensor_f32,
)
from .intn import dequantize_channels
from .lut import lut16_dequant
from .shadow import extract_outliers, shadow_delta_onepass, shadow_gemm
from .threads import matmul_wt
from .tiles import dequantize_tiles_t, tiles_q4_rows

W8A8_SCHEMES = {"w8a8", "w8a8-shadow", "w8a8c-shadow"}  # an int8 GEMM with a per-tensor activation scale
SHADOW_SCHEMES = {"w8a8-shadow", "w8a8c-shadow"}        # plus mllm-NPU's float shadow GEMM of the outliers
W8A8_KINDS, SHADOW_KINDS = W8A8_SCHEMES, SHADOW_SCHEMES  # their names before records said `scheme`
WEIGHT_FIELDS = ("w", "wt", "codes", "scales", "blocks")  # record fields naming a linear's weight blobs


def scheme_of(rec: dict) -> str | None:
    """The record's scheme name: its `scheme` field, else the `kind` field that manifests, plans and agents used
    for it before (saved files and wire messages are contracts: an old record still loads and runs)."""
    s = rec.get("scheme")
    return rec.get("kind") if s is None else s


def weight_blobs(rec: dict) -> set:
    """The blob shas holding a record's weights (what streaming an expert from flash reads)."""
    return {v for k, v in rec.items() if k in WEIGHT_FIELDS and isinstance(v, str)}


def x_wt(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x float32[M, K] @ w[N, K]^T: the host's one GEMM (edgeprobe_kernels.threads.matmul_wt: fixed column blocks,
    the transposed form for few rows)."""
    return matmul_wt(x, w)


def run_float(rec, get, counters):
    w = get(rec["w"])
    return lambda x, counters=counters: x_wt(x, w)


def run_w8a8(rec, get, counters, cols=None, keep_f32: bool = False, layout=None):
    """cols (a, b): only output channels a..b-1 (one side of a row-cut split, HeteroLLM §4.1). keep_f32: keep
    the int8 weight's float32 copy for the exact BLAS path (the agent, which runs one weight every step), unless
    this CPU runs int8 GEMMs itself (int8_gemm.GEMM_INT8: AVX2), which read an int8 row-major copy instead.
    layout(sha) -> that row-major int8[N, K] copy of the whole weight (the agent keeps it in flash: FlashStore.layout);
    without it, or with cols, the copy is made here from the record's k-major int8[K, N] `wt`, which is then
    only read where a path needs it (the row-dot kernels alone never keep it)."""
    sa = rec["scale_a"]
    scale = w8a8_scale(rec, get, cols)
    k_major = []

    def wt():
        if not k_major:
            w = get(rec["wt"])
            k_major.append(np.ascontiguousarray(w[:, cols[0]:cols[1]]) if cols is not None else w)
        return k_major[0]

    wf = int8_gemm.as_f32(wt()) if keep_f32 and not int8_gemm.GEMM_INT8 else None
    rows_major = []  # (int8[N, K], float32[N] scales), made at the first call needing them (racing lanes: equal copies)

    def linear(x, counters=counters):
        small = x.shape[0] <= GEMV_M
        # without numba the BLAS paths below: no transposed copy
        if (small and int8_gemm.numba is not None) or int8_gemm.GEMM_INT8:
            if not rows_major:
                w = layout(rec["wt"]) if layout is not None and cols is None else int8_gemm.rows_major(wt())
                rows_major.append((w, np.array(np.broadcast_to(scale, w.shape[0]), np.float32)))
            return (linear_w8a8_gemv if small else int8_gemm.linear_w8a8_gemm)(x, sa, *rows_major[0])
        if wf is not None:  # BLAS on the float32 codes: exact int32 sums (K-blocks of <= EXACT_K)
            c = gemm_codes_f32(quantize_per_tensor_f32(x, sa), wf)
        else:
            c = gemm_s8s32(quantize_per_tensor(x, sa), wt()).astype(np.float32)
        c *= scale  # exact int32 sums on every path: the same bits
        return c
    return linear


def w8a8_scale(rec, get, cols=None):
    """The factor from int32 sums to y: float32 scale_a * scale_w (per tensor), or float32[N] scale_a * the
    record's per-output-channel weight scales (w8a8c-shadow: QNN/HTP's axis-quantized weights)."""
    if rec.get("scale_w_ch") is None:
        return np.float32(rec["scale_a"] * rec["scale_w"])
    sw = np.asarray(get(rec["scale_w_ch"]), np.float32)
    if cols is not None:
        sw = sw[cols[0]:cols[1]]
    return np.float32(rec["scale_a"]) * sw


def run_shadow(rec, get, counters, keep_f32: bool = False, layout=None):
    """mllm-NPU eq. 1: the int8 GEMM plus the float shadow GEMM of the outliers (x - clip(x)). keep_f32, layout: as
    run_w8a8."""
    base, delta = run_w8a8(rec, get, counters, keep_f32=keep_f32, layout=layout), shadow_delta(rec, get, counters)
    if not rec["shadow"]:
        return base  # pruned layer: outliers are clipped, no CPU work
    return lambda x, counters=counters: base(x) + delta(x, counters)


def run_smoothquant(rec, get, counters):
    inner = run_w8a8(rec, get, counters)
    s = get(rec["smooth"])
    return lambda x, counters=counters: inner(x / s, counters)


def run_llm_int8(rec, get, counters):
    wt, sw, thr = get(rec["wt"]), get(rec["scale_w_rows"]), rec["threshold"]

    def linear(x, counters=counters):
        cols = np.nonzero((np.abs(x) > thr).any(axis=0))[0]
        xi = x.copy()
        xi[:, cols] = 0.0
        sx = np.maximum(np.abs(xi).max(axis=1), 1e-12) / 127.0
        xq = np.clip(np.rint(xi / sx[:, None]), -127, 127).astype(np.int8)
        y = gemm_s8s32(xq, wt).astype(np.float32) * sx[:, None].astype(np.float32) * sw[None, :]
        if len(cols):  # LLM.int8(): the outlier columns in 16-bit with the dequantized weights
            y += x[:, cols] @ (wt[cols].astype(np.float32) * sw[None, :])
            counters["outlier_columns"] = counters.get("outlier_columns", 0) + len(cols)
        return y
    return linear


def q4_0_dequant(blocks: np.ndarray, N: int, Kp: int) -> np.ndarray:
    """ggml Q4_0 blocks (2-byte FP16 d, 16 bytes: value j low nibble, j+16 high) -> float16[N, Kp] via vlut16."""
    b = blocks.reshape(-1, 18)
    d = np.ascontiguousarray(b[:, :2]).view("<f2").reshape(-1)
    nib = b[:, 2:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=1)
    return lut16_dequant(q, d).reshape(N, Kp)


def run_q4_0(rec, get, counters):
    N, K = rec["shape"]
    w = q4_0_dequant(get(rec["blocks"]), N, rec["padded_k"])[:, :K].astype(np.float32)
    return lambda x, counters=counters: x_wt(x.astype(np.float16).astype(np.float32), w)  # A16: FP16 activations


def run_q4_0_tile(rec, get, counters):
    N, K = rec["shape"]
    w = dequantize_tiles_t(get(rec["blocks"]), N, K).T  # float32[N, K] view of the k-major weight
    return lambda x, counters=counters: x_wt(x.astype(np.float16).astype(np.float32), w)


def run_q4_0_tile_seq(rec, get, counters):
    """q4_0-tile as the npu lane computes it: float32 sums over k in order (kernels/f16_gemm.py), the same
    bits as the hvx backend's DSP kernel; 1.5-4x slower than BLAS, so host simulations keep run_q4_0_tile.
    The runner keeps the codes and scales in row order (tiles_q4_rows, 4.5 bits a weight): up to GEMV_M rows
    (decode) read them directly; more rows (prefill) dequantize them to the k-major float32 weight per call."""
    N, K = rec["shape"]
    blocks = get(rec["blocks"])
    codes, d16 = tiles_q4_rows(blocks, N, K)
    if f16_gemm.numba is None or not f16_gemm.q4_rows_exact(d16):  # scales beyond FP16 range: the float32 copy
        wt = dequantize_tiles_t(blocks, N, K)  # k-major, f16 values
        return lambda x, counters=counters: gemm_f16w_seq(x, wt)

    def linear(x, counters=counters):
        if x.shape[0] <= f16_gemm.GEMV_M:
            return f16_gemm.gemv_q4_seq(x, codes, d16, N, K)
        return gemm_f16w_seq(x, f16_gemm.q4_rows_t(codes, d16, N, K))
    return linear


def run_moe_mixed(rec, get, counters):
    N, K = rec["shape"]
    w = dequantize_channels(get(rec["codes"]), get(rec["scales"]), rec["bits"], K)
    return lambda x, counters=counters: x_wt(x, w)


def shadow_delta(rec, get, counters):
    """The float half of mllm-NPU eq. 1 alone: x -> (x - clip(x)) @ W^T from the shadow rows, so it
    can run on another lane than the int8 GEMM (zeros for a pruned layer)."""
    N = rec["shape"][0]
    if not rec["shadow"]:
        return lambda x, counters=counters: np.zeros((x.shape[0], N), np.float32)
    clip, slot = rec["clip"], get(rec["slot"])
    hot, cold = get(rec["hot"]), get(rec["cold"])

    def delta(x, counters=counters):
        counters["shadow_values"] = counters.get("shadow_values", 0) + x.size  # of which `outliers` went to float
        one = shadow_delta_onepass(x, clip, slot, hot, cold, N)
        if one is not None:  # one numba pass, the same bits and counts
            y, n_out, n_cold = one
            if n_out:
                counters["outliers"] = counters.get("outliers", 0) + n_out
                counters["cold_rows_read"] = counters.get("cold_rows_read", 0) + n_cold
                counters["cold_bytes_read"] = (counters.get("cold_bytes_read", 0)
                                               + int(n_cold * cold.shape[1] * cold.itemsize))
            return y
        y = np.zeros((x.shape[0], N), np.float32)
        rows, cols, vals = extract_outliers(x, clip)
        if len(rows):
            shadow_gemm(rows, cols, vals, slot, hot, cold, y)
            cold_ch = np.unique(cols[slot[cols] < 0])
            counters["outliers"] = counters.get("outliers", 0) + len(rows)
            counters["cold_rows_read"] = counters.get("cold_rows_read", 0) + len(cold_ch)
            counters["cold_bytes_read"] = (counters.get("cold_bytes_read", 0)
                                           + int(len(cold_ch) * cold.shape[1] * cold.itemsize))
        return y
    return delta


RUNNERS = {
    "float": run_float,
    "w8a8": run_w8a8,
    "w8a8-shadow": run_shadow,
    "w8a8c-shadow": run_shadow,  # per-channel weight scales: run_w8a8 reads scale_w_ch
    "smoothquant": run_smoothquant,
    "llm-int8": run_llm_int8,
    "q4_0": run_q4_0,
    "q4_0-tile": run_q4_0_tile,
    "moe-mixed": run_moe_mixed,
}
NPU_RUNNERS = {**RUNNERS, "q4_0-tile": run_q4_0_tile_seq}  # the npu lane's fixed summation order
