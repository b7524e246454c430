"""int8 x int8 -> int32 GEMM with per-tensor scales: what an NPU's matrix unit computes for W8A8.

C[m, n] = sum_k A[m, k] * B[n, k] exactly in int32 (B is the weight, one output channel per row),
then y = C * (scale_a * scale_b) in float32 (mllm-NPU §3.3, eq. 1, int8 part).
"""
from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:
    numba = None


def gemm_s8s32_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a: int8[M, K], b: int8[N, K] -> int32[M, N] (numpy reference, exact)."""
    return a.astype(np.int32) @ b.astype(np.int32).T


if numba is not None:
    @numba.njit(parallel=True, nogil=True, cache=True)
    def _gemm_s8s32_nb(a, b, c):
        M, K = a.shape
        N = b.shape[0]
        nblk = (M + 3) // 4
        for blk in numba.prange(nblk):  # 4 rows of A share each row of B read from memory
            m0 = blk * 4
            if m0 + 4 <= M:
                for n in range(N):
                    s0 = np.int32(0)
                    s1 = np.int32(0)
                    s2 = np.int32(0)
                    s3 = np.int32(0)
                    for k in range(K):
                        w = np.int32(b[n, k])
                        s0 += np.int32(a[m0, k]) * w
                        s1 += np.int32(a[m0 + 1, k]) * w
                        s2 += np.int32(a[m0 + 2, k]) * w
                        s3 += np.int32(a[m0 + 3, k]) * w
                    c[m0, n] = s0
                    c[m0 + 1, n] = s1
                    c[m0 + 2, n] = s2
                    c[m0 + 3, n] = s3
            else:
                for m in range(m0, M):
                    for n in range(N):
                        s = np.int32(0)
                        for k in range(K):
                            s += np.int32(a[m, k]) * np.int32(b[n, k])
                        c[m, n] = s


def gemm_s8s32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a: int8[M, K], b: int8[N, K] -> int32[M, N]; numba 4-row-blocked kernel when available."""
    if a.dtype != np.int8 or b.dtype != np.int8 or a.shape[1] != b.shape[1]:
        raise ValueError(f"gemm_s8s32 needs int8[M, K] and int8[N, K], got {a.dtype}{a.shape} and {b.dtype}{b.shape}")
    if numba is None:
        return gemm_s8s32_ref(a, b)
    c = np.empty((a.shape[0], b.shape[0]), np.int32)
    _gemm_s8s32_nb(np.ascontiguousarray(a), np.ascontiguousarray(b), c)
    return c


def quantize_per_tensor(x: np.ndarray, scale: float) -> np.ndarray:
    """float -> int8: clip(round(x / scale), -127, 127) (symmetric, round half to even)."""
    return np.clip(np.rint(x / np.float32(scale)), -127, 127).astype(np.int8)
