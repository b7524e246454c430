"""The sparse shadow-outlier GEMM of mllm-NPU (§3.3, eq. 1, float part), run on the CPU.

x_out = x - clip(x, -c, c) is non-zero only at outliers. For every outlier (m, j, v):
y[m, :] += v * W^T[j, :], the float weight row of input channel j. Rows of hot channels are resident
in memory; the rest live in a cold store read on demand (mllm-NPU keeps only hot-channel rows).
"""
from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:
    numba = None


def extract_outliers(x: np.ndarray, clip: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32[M, K] -> (rows int64[n], cols int64[n], vals float32[n]) of x - clip(x, -c, c) != 0."""
    rows, cols = np.nonzero(np.abs(x) > clip)
    v = x[rows, cols]
    return rows, cols, (v - np.clip(v, -clip, clip)).astype(np.float32)


def shadow_gemm_ref(rows, cols, vals, slot, hot, cold, y) -> None:
    """y float32[M, N] += outliers @ W^T rows. slot int64[K]: >= 0 index into hot float32[H, N],
    else -1 - index into cold float32[C, N]."""
    for m, j, v in zip(rows, cols, vals):
        s = slot[j]
        y[m] += v * (hot[s] if s >= 0 else cold[-1 - s])


if numba is not None:
    @numba.njit(nogil=True, cache=True)
    def _shadow_gemm_nb(rows, cols, vals, slot, hot, cold, y):
        N = y.shape[1]
        for i in range(rows.shape[0]):
            m, s, v = rows[i], slot[cols[i]], vals[i]
            if s >= 0:
                for n in range(N):
                    y[m, n] += v * hot[s, n]
            else:
                for n in range(N):
                    y[m, n] += v * cold[-1 - s, n]


def shadow_gemm(rows, cols, vals, slot, hot, cold, y) -> None:
    """See shadow_gemm_ref (numba kernel when available; same float32 operations in the same order)."""
    if numba is None or len(rows) == 0:
        return shadow_gemm_ref(rows, cols, vals, slot, hot, cold, y)
    _shadow_gemm_nb(rows.astype(np.int64), cols.astype(np.int64), vals.astype(np.float32), slot, hot, cold, y)
