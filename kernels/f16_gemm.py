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

from .simd import F16C, Q4_LANES

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


# ---- the same GEMM from 4-bit codes: decode reads 4.5 bits a weight, not a float32 copy ----------------------
GEMV_M = 16  # up to this many rows (decode, a batch of candidates) the GEMV reads the codes; more dequantize first
GEMV_ALONE = 1 << 18  # fewer weights x rows than this (a decode step's k and v, ~50 us) run on the calling thread
GEMV_CHUNK = 1024  # most columns per task: its accumulators and scales stay in L1
D_MAX = 4096.0  # scales up to this |d|: (q - 8) d stays below 65504, no FP16 overflow, and _round_f16 is exact


_Q4_TABLE = None


def q4_table() -> np.ndarray:
    """float32[65536, 16]: row b holds fp16((q - 8) d) for q = 0..15 and the FP16 scale d of bits b (vlut16's table
    of every scale; rows of scales past D_MAX are never read): what the SIMD columns look codes up in with 16 lanes
    (simd.Q4_LANES), built once a process; with 8 lanes (never read) one row."""
    global _Q4_TABLE
    if _Q4_TABLE is None:  # two lanes may build it at once: each a whole table, published when filled
        if Q4_LANES != 16:
            table = np.zeros((1, 16), np.float32)
        else:
            d = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
            buf = np.empty(65536 * 16 + 16, np.float32)  # rows on 64-byte lines: one line a lookup
            at = (-buf.ctypes.data % 64) // 4
            table = buf[at:at + 65536 * 16].reshape(65536, 16)
            with np.errstate(over="ignore", invalid="ignore"):  # rows of scales the GEMV never takes
                table[:] = ((np.arange(16, dtype=np.float32) - np.float32(8))[None, :] * d[:, None]).astype(np.float16)
        _Q4_TABLE = table
    return _Q4_TABLE


def q4_rows_exact(d16: np.ndarray) -> bool:
    """True when every FP16 scale (uint16 bits) is finite with |d| <= D_MAX: then the codes kernels below give
    the bits of dequantize_tiles_t. Quantized real weights always are; other blocks take the float32 path."""
    d = np.asarray(d16, np.uint16).view(np.float16).astype(np.float32)
    return bool(np.all(np.isfinite(d)) and np.all(np.abs(d) <= D_MAX))


if numba is not None:
    from .lut import _bits_f32, _f32_bits

    if F16C:  # their codegen (8 or 16 lanes, simd.Q4_LANES) is compiled into this file's cached kernels
        from .simd import q4_cols16_f16, q4_cols64_f16, q4_rows4_cols16_f16

    @numba.njit(inline="always")
    def _round_f16(v):
        # v = (q - 8) d is exact in float32 (4 x 11 bits): round it to FP16 (nearest even) on its bits. A normal
        # FP16 result keeps 10 fraction bits; a subnormal one (d subnormal) is a multiple of 2^-24 below 2^-14,
        # which already has at most 10 significant bits, so the same add-and-mask leaves it as it is.
        b = _f32_bits(v)
        b = (b + np.uint32(0x0FFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
        return _bits_f32(np.uint32(b))

    @numba.njit(nogil=True, cache=True)
    def _gemv_q4_cols(xh, codes, d16, f16_of, tab, y, n0, n1):
        # y[:, n0:n1] (n0 a multiple of 16); xh float32[M', 2 Kh] (FP16 values, zero past K; M' = 1 or a multiple
        # of 4, zero past M), codes uint8[Kh, Np], d16 uint16[Kh, Np/16]
        M = y.shape[0]
        Kh = codes.shape[0]
        w = n1 - n0
        wp = (w + 15) // 16 * 16  # whole groups: Np is a multiple of 32
        acc = np.zeros((xh.shape[0], wp), np.float32)
        if F16C:  # a constant: numba compiles one branch (the intrinsics exist only where it is true)
            if M == 1:  # 64 columns a pass over the rows, sums in registers (simd.q4_cols64_f16)
                j = 0
                while j + 64 <= wp:
                    q4_cols64_f16(xh, codes, d16, tab, acc, n0 + j, j, Kh)
                    j += 64
                while j < wp:
                    q4_cols16_f16(xh, codes, d16, tab, acc, n0 + j, j, Kh)
                    j += 16
            else:  # blocks of 4 rows (xh's zero rows past M add nothing), each code dequantized once a block
                for m0 in range(0, M, 4):
                    for j in range(0, wp, 16):
                        q4_rows4_cols16_f16(xh, codes, d16, tab, acc, n0 + j, j, Kh, m0)
        else:
            _gemv_q4_loop(xh, codes, d16, f16_of, acc, M, n0, wp)
        for m in range(M):
            y[m, n0:n1] = acc[m, :w]

    @numba.njit(nogil=True, cache=True)
    def _gemv_q4_loop(xh, codes, d16, f16_of, acc, M, n0, wp):
        # acc[:M, :wp] += the columns n0.. of the GEMV, in numba (CPUs without F16C): each weight rounded on its bits
        Kh = codes.shape[0]
        dcol = np.empty(wp, np.float32)
        g0 = n0 // 16
        a = acc[0]
        for r in range(Kh):
            if M == 1:  # a group (16 columns, rows 2r and 2r + 1) at a time: its scale a scalar, k = 2r then 2r + 1
                xa, xb = xh[0, 2 * r], xh[0, 2 * r + 1]
                for g in range(wp // 16):
                    d = f16_of[d16[r, g0 + g]]
                    row = codes[r, n0 + 16 * g:n0 + 16 * g + 16]
                    ag = a[16 * g:16 * g + 16]
                    for j in range(16):
                        c = np.int32(row[j])
                        va = _round_f16(np.float32(np.int32((c & 15) - 8)) * d)
                        vb = _round_f16(np.float32(np.int32((c >> 4) - 8)) * d)
                        ag[j] += xa * va
                        ag[j] += xb * vb
                continue
            for g in range(wp // 16):
                dv = f16_of[d16[r, g0 + g]]
                for j in range(16):
                    dcol[16 * g + j] = dv
            row = codes[r, n0:n0 + wp]
            for m0 in range(0, M, 4):  # blocks of 4 rows (zero rows past M add nothing): dequantized once a block
                xa0, xb0 = xh[m0, 2 * r], xh[m0, 2 * r + 1]
                xa1, xb1 = xh[m0 + 1, 2 * r], xh[m0 + 1, 2 * r + 1]
                xa2, xb2 = xh[m0 + 2, 2 * r], xh[m0 + 2, 2 * r + 1]
                xa3, xb3 = xh[m0 + 3, 2 * r], xh[m0 + 3, 2 * r + 1]
                a0, a1, a2, a3 = acc[m0], acc[m0 + 1], acc[m0 + 2], acc[m0 + 3]
                for j in range(wp):
                    c = np.int32(row[j])
                    d = dcol[j]
                    va = _round_f16(np.float32(np.int32((c & 15) - 8)) * d)
                    vb = _round_f16(np.float32(np.int32((c >> 4) - 8)) * d)
                    a0[j] += xa0 * va
                    a0[j] += xb0 * vb
                    a1[j] += xa1 * va
                    a1[j] += xb1 * vb
                    a2[j] += xa2 * va
                    a2[j] += xb2 * vb
                    a3[j] += xa3 * va
                    a3[j] += xb3 * vb

    @numba.njit(parallel=True, nogil=True, cache=True)
    def _gemv_q4_nb(xh, codes, d16, f16_of, tab, y, chunk):
        N = y.shape[1]
        for t in numba.prange((N + chunk - 1) // chunk):
            _gemv_q4_cols(xh, codes, d16, f16_of, tab, y, t * chunk, min(N, (t + 1) * chunk))

    @numba.njit(nogil=True, cache=True)
    def _gemv_q4_dealt(xh, codes, d16, f16_of, tab, y, K, tasks):
        # y = the GEMV of xh's rows (FP16 values, zero past K) over y's N columns, dealt to `tasks` threads (the
        # caller's numba count: read in njit code it is a pointer numba cannot cache); gemv_q4_seq and the compiled
        # decode layer (decode_layer._linear_q4) deal alike
        N = y.shape[1]
        most = max(16, min(GEMV_CHUNK, 4096 // xh.shape[0]) // 16 * 16)  # accumulators: 16 KiB at most
        if tasks == 1 or N * K * xh.shape[0] < GEMV_ALONE:  # a small weight: no parallel region to start and join
            for n0 in range(0, N, most):
                _gemv_q4_cols(xh, codes, d16, f16_of, tab, y, n0, min(N, n0 + most))
        else:  # one task per thread, whole groups
            _gemv_q4_nb(xh, codes, d16, f16_of, tab, y, min(most, ((N + tasks - 1) // tasks + 15) // 16 * 16))

    @numba.njit(parallel=True, nogil=True, cache=True)
    def _q4_rows_t_nb(codes, d16, f16_of, out):
        # out float32[K, N]: the k-major FP16 values, two rows per byte row of codes
        K, N = out.shape
        for r in numba.prange((K + 1) // 2):
            for n in range(N):
                c = np.int32(codes[r, n])
                d = f16_of[d16[r, n >> 4]]
                out[2 * r, n] = _round_f16(np.float32(np.int32((c & 15) - 8)) * d)
                if 2 * r + 1 < K:
                    out[2 * r + 1, n] = _round_f16(np.float32(np.int32((c >> 4) - 8)) * d)


def q4_rows_t(codes: np.ndarray, d16: np.ndarray, N: int, K: int) -> np.ndarray:
    """(codes, d16) of kernels/tiles.py tiles_q4_rows -> W^T float32[K, N] holding FP16 values: the bits of
    dequantize_tiles_t when q4_rows_exact(d16)."""
    from .lut import _f16_values

    out = np.empty((K, N), np.float32)
    _q4_rows_t_nb(codes, d16, _f16_values(), out)
    return out


def gemv_q4_seq(x: np.ndarray, codes: np.ndarray, d16: np.ndarray, N: int, K: int) -> np.ndarray:
    """x float32[M, K] times the q4_0-tile weight in its row layout (tiles_q4_rows: codes uint8[Kp/2, Np], d16
    uint16[Kp/2, Np/16]) -> float32[M, N]: the bits of gemm_f16w_seq(x, dequantize_tiles_t(blocks, N, K)) when
    q4_rows_exact(d16). Each weight is dequantized on the fly to FP16 as vlut16 does, w = fp16((q - 8) d), and
    every y[m, n] sums x[m, k] w[k, n] over k in order; it reads 0.5625 bytes a weight instead of 4."""
    if x.ndim != 2 or x.shape[1] != K or codes.shape[0] * 2 < K or codes.shape[1] < N:
        raise ValueError(f"gemv_q4_seq needs x[M, {K}] and codes of a [{N}, {K}] weight, got {x.shape}, "
                         f"{codes.shape}")
    from .lut import _f16_values

    Kh = codes.shape[0]
    M = x.shape[0]
    xh = np.zeros((M if M == 1 else -(-M // 4) * 4, 2 * Kh), np.float32)  # zeros past K and M: add nothing
    xh[:M, :K] = x.astype(np.float16)
    y = np.empty((x.shape[0], N), np.float32)
    _gemv_q4_dealt(xh, codes, d16, _f16_values(), q4_table(), y, K, max(1, numba.get_num_threads()))
    return y
