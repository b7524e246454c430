"""The LM head with llama.cpp's Q8_0 weights: int8 codes with one float scale per 32 inputs (ggml's block_q8_0),
times float32 activations.

SmolLM2's GGUF stores `token_embd` (its tied output) as Q8_0, so `quantize_q8_0` of the dequantized table gives
back the file's codes and scales exactly, and the head computes with the very weights of the float model while
reading 1.125 bytes per weight instead of 4: at batch 1 the head is a GEMV over the whole vocabulary, bound by
those bytes. Activations stay float (no rounding step that a 1-ulp difference could flip), so the decode kernel
(numba, M <= GEMV_M: decode steps and batches of candidates) and the BLAS path (prefill rows, perplexity) agree to
float32 summation order.
"""
from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:
    numba = None

from .threads import run_blocks

QK = 32  # values per block (ggml's QK8_0)
ROWS = 4096  # output rows dequantized at a time on the BLAS path (no float copy of the whole head)
# up to this many rows (decode, a batch of candidates) the numba kernel, ~1.5 ms a row for SmolLM2's 49152 x 576 head
# on 2 cores; the BLAS path spends ~80 ms dequantizing it whatever the rows
GEMV_M = 32


QUANT_ROWS = 256  # rows quantized at a time: the temporaries stay in cache (Gemma 3's head: 4.1 s whole, 0.7 s so)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32[M, K] (K a multiple of 32) -> codes int8[M, K], scales float32[M, K/32]: d = absmax/127 per block,
    q = round(x / d) (ggml rounds half away from zero; |x/d| <= 127, so no clipping is needed)."""
    M, K = x.shape
    if K % QK:
        raise ValueError(f"Q8_0 needs rows of a multiple of {QK} values, got {K}")
    x = np.asarray(x, np.float32)
    q, d = np.empty((M, K), np.int8), np.empty((M, K // QK), np.float32)
    for s in range(0, M, QUANT_ROWS):
        b = x[s:s + QUANT_ROWS].reshape(-1, K // QK, QK)
        ds = (np.abs(b).max(axis=2) / np.float32(127)).astype(np.float32)
        inv = np.divide(np.float32(1), ds, out=np.zeros_like(ds), where=ds > 0)
        r = b * inv[:, :, None]
        q[s:s + QUANT_ROWS] = (np.sign(r) * np.floor(np.abs(r) + np.float32(0.5))).astype(np.int8).reshape(-1, K)
        d[s:s + QUANT_ROWS] = ds
    return q, d


def dequantize_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """codes int8[N, K], scales float32[N, K/32] -> float32[N, K]."""
    N, K = q.shape
    return (q.reshape(N, K // QK, QK).astype(np.float32) * d[:, :, None]).reshape(N, K)


if numba is not None:
    # No fastmath: with it LLVM picks the order of the row's sum, and two compilations of one kernel (a writable and
    # a read-only blob's specializations, cached by different processes) summed differently, ~1e-5 apart. Here the
    # order is the code's: 32 lanes (vertical adds, vectorized without reassociation), then a fixed halving fold.
    @numba.njit(parallel=True, nogil=True, cache=True)
    def _matmul_q8_0_nb(x, q, d, y):
        M, K = x.shape
        V = q.shape[0]
        for blk in numba.prange((V + 63) // 64):  # 64 output rows per task: less scheduling per row
            acc = np.empty(QK, np.float32)
            for v in range(blk * 64, min(V, blk * 64 + 64)):
                row, dv = q[v], d[v]
                for m in range(M):
                    xm = x[m]
                    acc[:] = 0
                    for b in range(K // QK):  # lane j accumulates the block's j-th scaled product
                        db = dv[b]
                        for j in range(QK):
                            acc[j] += db * (np.float32(row[b * QK + j]) * xm[b * QK + j])
                    w = QK // 2
                    while w > 0:  # lanes j and j + w, halving: 16 + 8 + 4 + 2 + 1 vertical adds
                        for j in range(w):
                            acc[j] += acc[j + w]
                        w //= 2
                    y[m, v] = acc[0]


def matmul_q8_0(x: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """x float32[M, K] @ (Q8_0 weights: codes int8[N, K], scales float32[N, K/32])^T -> float32[M, N]."""
    M, K = x.shape
    if q.shape[1] != K or d.shape != (q.shape[0], K // QK):
        raise ValueError(f"Q8_0 head of codes {q.shape}, scales {d.shape} cannot take rows of {K} values")
    N = q.shape[0]
    x = np.ascontiguousarray(x, np.float32)
    if numba is not None and M <= GEMV_M:
        y = np.empty((M, N), np.float32)
        _matmul_q8_0_nb(x, q, d, y)
        return y
    y = np.empty((M, N), np.float32)

    def block(a, b):
        y[:, a:b] = x @ dequantize_q8_0(q[a:b], d[a:b]).T

    run_blocks(block, ((v, min(N, v + ROWS)) for v in range(0, N, ROWS)))  # fixed blocks: the same bits at any width
    return y
