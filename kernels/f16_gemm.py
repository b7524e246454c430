"""The W4A16 GEMM of the npu lane (q4_0-tile, NPU test-time scaling §5): float16 activations times float16
weights, float32 sums taken over k in order.

Every product of two float16 values is exact in float32 (11 x 11 significand bits), so a GEMM's result is
fixed by the order of its additions alone. BLAS picks its own blocks and SIMD lanes; a phone's HMX its own.
The npu lane fixes one: each y[m, n] = ((x[m, 0] w[n, 0] + x[m, 1] w[n, 1]) + ...) from 0, the order the
Hexagon kernel (kernels/hvx/gemm_f16.c) uses, so the numba and hvx backends give the same bits.

`gemm_f16w_seq(x float32[M, K], wt float32[K, N] holding float16 values) -> float32[M, N]`: x is rounded to
float16 first (A16). The loop runs k outermost per block of 4 rows and 512 columns and vectorizes over n,
where the lanes are independent sums, so the order holds without fastmath.
"""
from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:
    numba = None

N_BLOCK = 512  # columns per task: one block of y (4 x 2 KiB) stays in L1 while w's rows stream past


def gemm_f16w_seq_ref(x: np.ndarray, w16: np.ndarray) -> np.ndarray:
    """float16(x) @ w16^T (w16 float16[N, K]) with float32 sums over k in order: float32[M, N] (numpy)."""
    xh, wf = x.astype(np.float16).astype(np.float32), w16.astype(np.float32)
    y = np.zeros((x.shape[0], w16.shape[0]), np.float32)
    for k in range(x.shape[1]):
        y += xh[:, k:k + 1] * wf[:, k][None, :]  # exact products, one rounding per add
    return y


if numba is not None:
    @numba.njit(parallel=True, nogil=True, cache=True)
    def _gemm_f16w_seq_nb(xh, wt, y):
        M, K = xh.shape
        N = wt.shape[1]
        mb, nb = (M + 3) // 4, (N + N_BLOCK - 1) // N_BLOCK
        for task in numba.prange(mb * nb):  # decode (M = 1) still spreads over the cores by columns
            m0, n0 = (task // nb) * 4, (task % nb) * N_BLOCK
            rows, n1 = min(4, M - m0), min(N, n0 + N_BLOCK)
            acc = np.zeros((4, n1 - n0), np.float32)
            a0, a1, a2, a3 = acc[0], acc[1], acc[2], acc[3]
            for k in range(K):
                wk = wt[k, n0:n1]
                x0 = xh[m0, k]
                x1 = xh[m0 + 1, k] if rows > 1 else np.float32(0)
                x2 = xh[m0 + 2, k] if rows > 2 else np.float32(0)
                x3 = xh[m0 + 3, k] if rows > 3 else np.float32(0)
                for n in range(n1 - n0):  # independent sums per lane: vectorized, each still in k order
                    w = wk[n]
                    a0[n] += x0 * w
                    a1[n] += x1 * w
                    a2[n] += x2 * w
                    a3[n] += x3 * w
            for r in range(rows):
                y[m0 + r, n0:n1] = acc[r]


def gemm_f16w_seq(x: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """x float32[M, K], wt float32[K, N] (float16 values, k-major) -> float32[M, N], sums over k in order."""
    if x.ndim != 2 or wt.ndim != 2 or x.shape[1] != wt.shape[0]:
        raise ValueError(f"gemm_f16w_seq needs x[M, K] and wt[K, N], got {x.shape} and {wt.shape}")
    xh = np.ascontiguousarray(x.astype(np.float16).astype(np.float32))
    if numba is None:
        return gemm_f16w_seq_ref(xh, np.ascontiguousarray(wt.T))
    y = np.empty((x.shape[0], wt.shape[1]), np.float32)
    _gemm_f16w_seq_nb(xh, np.ascontiguousarray(wt, np.float32), y)
    return y
