"""int8 x int8 -> int32 GEMM with per-tensor scales: what an NPU's matrix unit computes for W8A8.

C[m, n] = sum_k A[m, k] * Bt[k, n] exactly in int32, then y = C * (scale_a * scale_b) in float32
(mllm-NPU §3.3, eq. 1, int8 part). The weight is stored k-major (Bt int8[K, N], row k = the weights
every output channel applies to input channel k), the layout an outer-product kernel streams:
each int8 product fits int16 (|127 * 127| < 2^15) and is accumulated in int32, as vector units do.

Exact implementations: `gemm_s8s32` runs float32 BLAS on K-blocks of at most EXACT_K rows, inside which every
partial sum is an integer below 2^24 and so exact in float32, then adds the blocks in int32 — 3–4x the numba
integer kernel on one core here (bench/quant.py). `gemm_s8s32_numba` is the integer-only outer-product kernel,
kept to compare against. On AVX2 CPUs a whole W8A8 linear of any row count runs `linear_w8a8_gemm` (vpmaddubsw
in 4 x 2 register blocks on int8 rows: ~1.5x the BLAS path at 2 threads here, no float32 weight copy), and decode
rows `linear_w8a8_gemv`; all give the same int32 sums.
"""
from __future__ import annotations

import os

import numpy as np

try:
    import numba
except ImportError:
    numba = None

from .arena import ARENA
from .simd import AVX2, VNNI

if AVX2:
    from .simd import dot4x2_s8_avx2, dot_s8_avx2
if VNNI:
    from .simd import VNNI_STEP, dot1x4_u8s8_vnni, dot4x4_u8s8_vnni, gemm4x4_u8s8_vnni


def gemm_s8s32_ref(a: np.ndarray, bt: np.ndarray) -> np.ndarray:
    """a: int8[M, K], bt: int8[K, N] -> int32[M, N] (numpy reference, exact)."""
    return a.astype(np.int32) @ bt.astype(np.int32)


if numba is not None:
    @numba.njit(parallel=True, nogil=True, cache=True)
    def _gemm_s8s32_nb(a, bt, c):
        M, K = a.shape
        N = bt.shape[1]
        for blk in numba.prange((M + 3) // 4):  # 4 rows of A share every row of Bt read
            m0 = blk * 4
            rows = min(4, M - m0)
            acc = np.zeros((4, N), np.int32)
            acc0, acc1, acc2, acc3 = acc[0], acc[1], acc[2], acc[3]
            for k in range(K):
                bk = bt[k]
                x0 = np.int16(a[m0, k])
                x1 = np.int16(a[m0 + 1, k]) if rows > 1 else np.int16(0)
                x2 = np.int16(a[m0 + 2, k]) if rows > 2 else np.int16(0)
                x3 = np.int16(a[m0 + 3, k]) if rows > 3 else np.int16(0)
                for n in range(N):  # contiguous over n: vectorizes to int16 multiplies, int32 adds
                    w = np.int16(bk[n])
                    acc0[n] += np.int32(np.int16(x0 * w))
                    acc1[n] += np.int32(np.int16(x1 * w))
                    acc2[n] += np.int32(np.int16(x2 * w))
                    acc3[n] += np.int32(np.int16(x3 * w))
            for r in range(rows):
                c[m0 + r] = acc[r]


if numba is not None:
    @numba.njit(parallel=True, nogil=True, cache=True)
    def _to_f32_nb(w, out):
        for k in numba.prange(w.shape[0]):
            for n in range(w.shape[1]):
                out[k, n] = np.float32(w[k, n])


if numba is not None:
    @numba.njit(parallel=True, nogil=True, cache=True)
    def _transpose_nb(w, out):
        K, N = w.shape
        for kb in numba.prange((K + 7) // 8):  # 8 rows of w a pass: each n writes 8 contiguous bytes (unrolled)
            k0 = kb * 8
            if k0 + 8 <= K:
                for n in range(N):
                    for k in range(8):
                        out[n, k0 + k] = w[k0 + k, n]
            else:
                for n in range(N):
                    for k in range(k0, K):
                        out[n, k] = w[k, n]


def rows_major(wt: np.ndarray) -> np.ndarray:
    """int8[K, N] (the record's k-major weight) -> a new int8[N, K] in the decode arena (arena.py), the layout the
    row-dot kernels read (see transpose_into)."""
    out = ARENA.empty(wt.shape[::-1], wt.dtype)
    transpose_into(wt, out)
    return out


def transpose_into(wt: np.ndarray, out: np.ndarray) -> None:
    """out[...] = wt.T for int8[K, N] -> C-contiguous int8[N, K]: on every core numba has, ~7x numpy's strided
    int8 copy (1.7 ms for [576, 1536] here), which every linear's first decode or prefill call on the agent pays."""
    if numba is None or wt.ndim != 2 or not out.flags.c_contiguous:
        out[...] = wt.T
    else:
        _transpose_nb(wt, out)


def as_f32(w: np.ndarray) -> np.ndarray:
    """int8[K, N] -> a new float32[K, N] with the same values, cast on every core numba has: a model's first run
    makes all of these copies (424 MB for SmolLM2), and faulting in that fresh memory, not the cast, is most of
    the time (250 ms on one core here, 135 ms on two)."""
    if numba is None or w.ndim != 2:
        return w.astype(np.float32)
    out = np.empty(w.shape, np.float32)
    _to_f32_nb(np.ascontiguousarray(w), out)
    return out


if numba is not None:
    @numba.njit(nogil=True, inline="always")
    def _quantize_rows(x, sa, xq, m):
        for k in range(x.shape[1]):  # quantize_per_tensor, element for element: x / scale_a in float32, rint, clip
            v = np.rint(x[m, k] / sa)
            xq[m, k] = np.int8(min(max(v, np.float32(-127)), np.float32(127)))

    @numba.njit(nogil=True, inline="always")
    def _dot_s8s32(w_row, a_row):
        acc = np.int32(0)
        for k in range(w_row.shape[0]):  # contiguous int8 rows, int32 products and sums: LLVM emits vpmaddwd
            acc += np.int32(w_row[k]) * np.int32(a_row[k])
        return acc

    if AVX2:
        @numba.njit(nogil=True, inline="always")
        def _dot_q8(w_row, a_row):
            """_dot_s8s32 for activations quantized to [-127, 127] (quantize_per_tensor): 32 bytes per AVX2 step
            (simd.dot_s8_avx2), the K % 32 tail in scalar code; the same int32 sum."""
            K = w_row.shape[0]
            K32 = K - K % 32
            acc = dot_s8_avx2(a_row, w_row, K32)
            for k in range(K32, K):
                acc += np.int32(w_row[k]) * np.int32(a_row[k])
            return acc
    else:
        _dot_q8 = _dot_s8s32

    @numba.njit(parallel=True, nogil=True, cache=True)
    def _gemv_s8s32_nb(a, w, c):
        for n in numba.prange(w.shape[0]):  # one output channel per iteration: its weight row read once for all M
            for m in range(a.shape[0]):
                c[m, n] = _dot_s8s32(w[n], a[m])

    @numba.njit(parallel=True, nogil=True, cache=True)
    def _linear_w8a8_nb(x, sa, w, scale, y):
        M, K = x.shape
        xq = np.empty((M, K), np.int8)
        for m in range(M):
            _quantize_rows(x, sa, xq, m)
        for n in numba.prange(w.shape[0]):
            for m in range(M):
                y[m, n] = np.float32(_dot_q8(w[n], xq[m])) * scale[n]


if numba is not None:
    @numba.njit(parallel=True, nogil=True, cache=True)
    def _linear_w8a8_group_nb(x, sa, part, w, scale, y):
        M, K = x.shape
        xq = np.empty((sa.shape[0], M, K), np.int8)
        for p in range(sa.shape[0]):  # x quantized once per linear's scale_a, as _linear_w8a8_nb does
            for m in range(M):
                _quantize_rows(x, sa[p], xq[p], m)
        for n in numba.prange(w.shape[0]):
            for m in range(M):
                y[m, n] = np.float32(_dot_q8(w[n], xq[part[n], m])) * scale[n]


if AVX2:
    GEMM_NB = 16  # output channels per parallel chunk: their int8 rows (16 x K bytes) stay in L1/L2 while A streams

    @numba.njit(nogil=True, inline="always")
    def _tail(xq, w, m, n, k0):
        acc = np.int32(0)
        for k in range(k0, xq.shape[1]):  # the K % 32 products past the AVX2 steps
            acc += np.int32(w[n, k]) * np.int32(xq[m, k])
        return acc

    @numba.njit(parallel=True, nogil=True, cache=True)
    def _linear_w8a8_gemm_nb(x, sa, w, scale, y):
        M, K = x.shape
        N = w.shape[0]
        K32 = K - K % 32
        xq = np.empty((M, K), np.int8)
        for m in numba.prange(M):
            _quantize_rows(x, sa, xq, m)
        M4 = M - M % 4
        for blk in numba.prange((N + GEMM_NB - 1) // GEMM_NB):
            n_lo = blk * GEMM_NB
            n_hi = min(N, n_lo + GEMM_NB)
            n2 = n_hi - (n_hi - n_lo) % 2
            for m0 in range(0, M4, 4):
                for n0 in range(n_lo, n2, 2):
                    r = dot4x2_s8_avx2(xq, w, m0, n0, K32)
                    s0, s1 = scale[n0], scale[n0 + 1]  # unrolled: a tuple indexed at run time spills to memory
                    y[m0, n0] = np.float32(r[0] + _tail(xq, w, m0, n0, K32)) * s0
                    y[m0, n0 + 1] = np.float32(r[1] + _tail(xq, w, m0, n0 + 1, K32)) * s1
                    y[m0 + 1, n0] = np.float32(r[2] + _tail(xq, w, m0 + 1, n0, K32)) * s0
                    y[m0 + 1, n0 + 1] = np.float32(r[3] + _tail(xq, w, m0 + 1, n0 + 1, K32)) * s1
                    y[m0 + 2, n0] = np.float32(r[4] + _tail(xq, w, m0 + 2, n0, K32)) * s0
                    y[m0 + 2, n0 + 1] = np.float32(r[5] + _tail(xq, w, m0 + 2, n0 + 1, K32)) * s1
                    y[m0 + 3, n0] = np.float32(r[6] + _tail(xq, w, m0 + 3, n0, K32)) * s0
                    y[m0 + 3, n0 + 1] = np.float32(r[7] + _tail(xq, w, m0 + 3, n0 + 1, K32)) * s1
                for n in range(n2, n_hi):  # an odd chunk's last channel
                    for m in range(m0, m0 + 4):
                        y[m, n] = np.float32(_dot_q8(w[n], xq[m])) * scale[n]
            for m in range(M4, M):  # the last M % 4 rows
                for n in range(n_lo, n_hi):
                    y[m, n] = np.float32(_dot_q8(w[n], xq[m])) * scale[n]


if VNNI:
    @numba.njit(parallel=True, nogil=True, cache=True)
    def _linear_w8a8_gemm_vnni_nb(x, sa, w, scale, y, threads):
        """_linear_w8a8_gemm_nb with AVX-512 VNNI 4 x 4 register blocks (simd.dot4x4_u8s8_vnni: 16 zmm sums, 8
        loads a step): the activations' codes fed as a + 128, 128 * sum(w[n]) taken off each sum; the same int32
        sums. One parallel region, over `threads` row ranges (each quantizes its rows, then runs them past every
        weight): in the agent a region's fork wakes a sleeping worker (~80 us on this VM, a 64-row GEMM's half),
        and the quantization's own region doubled that."""
        M, K = x.shape
        N = w.shape[0]
        KV = K - K % VNNI_STEP
        xq = np.empty((M, K), np.int8)
        xu = np.empty((M, K), np.uint8)
        ones = np.ones((1, K), np.uint8)  # sum(w[n]) as a dot product: 64 bytes an instruction, ~5x a scalar loop
        parts = max(1, min(threads, (M + 3) // 4))
        step = ((M + 4 * parts - 1) // (4 * parts)) * 4  # rows a part: a multiple of 4
        for part in numba.prange(parts):
            r0 = part * step
            r1 = min(M, r0 + step)
            for m in range(r0, r1):
                _quantize_rows(x, sa, xq, m)
                for k in range(K):
                    xu[m, k] = np.uint8(np.int32(xq[m, k]) + 128)
            r4 = r1 - (r1 - r0) % 4
            off = np.empty(GEMM_NB, np.int32)  # 128 * sum(w[n, :KV]): the offset's share of each block's sums
            for n_lo in range(0, N, GEMM_NB):
                n_hi = min(N, n_lo + GEMM_NB)
                n4 = n_hi - (n_hi - n_lo) % 4
                for n0 in range(n_lo, n4, 4):
                    t = dot1x4_u8s8_vnni(ones, w, 0, n0, KV)
                    for j in range(4):
                        off[n0 + j - n_lo] = t[j] * np.int32(128)
                for m0 in range(r0, r4, 4):
                    for n0 in range(n_lo, n4, 4):
                        if KV == K:  # no tail: the block's epilogue in vectors too (the same bits)
                            gemm4x4_u8s8_vnni(xu, w, m0, n0, KV, off, n0 - n_lo, scale, y)
                            continue
                        r = dot4x4_u8s8_vnni(xu, w, m0, n0, KV)
                        for i in range(4):
                            for j in range(4):
                                n = n0 + j
                                y[m0 + i, n] = np.float32(r[4 * i + j] - off[n - n_lo]
                                                          + _tail(xq, w, m0 + i, n, KV)) * scale[n]
                    for n in range(n4, n_hi):  # a chunk's last N % 4 channels
                        for m in range(m0, m0 + 4):
                            y[m, n] = np.float32(_dot_q8(w[n], xq[m])) * scale[n]
                for m in range(r4, r1):  # the part's last rows past a block of 4
                    for n in range(n_lo, n_hi):
                        y[m, n] = np.float32(_dot_q8(w[n], xq[m])) * scale[n]


def linear_w8a8_gemm(x: np.ndarray, scale_a: float, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """A W8A8 linear of any row count on AVX2 (numba with AVX2 only: see GEMM_INT8): x float32[M, K] quantized per
    tensor with scale_a, times w int8[N, K] (row-major) in exact int32 over 4 x 2 register blocks of vpmaddubsw, or
    4 x 4 of vpdpbusd where the CPU has AVX-512 VNNI (simd.VNNI: ~2.2x here), times scale
    float32[N] -> float32[M, N]: linear_w8a8_gemv's bits at any M, and the float32 BLAS path's (exact int32 sums
    there too). mllm-NPU §3.3 eq. 1's int8 part as an NPU's matrix unit computes it: int8 in, int32 out."""
    if not GEMM_INT8:
        raise RuntimeError("linear_w8a8_gemm needs numba on an AVX2 CPU: use the BLAS path (gemm_codes_f32)")
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    x, w = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w)
    if VNNI:
        _linear_w8a8_gemm_vnni_nb(x, np.float32(scale_a), w, scale, y, numba.get_num_threads())
    else:
        _linear_w8a8_gemm_nb(x, np.float32(scale_a), w, scale, y)
    return y


# prefill's int8 GEMM runs on int8 weights (no float32 copy) where this is true; EDGEPROBE_INT8_GEMM=0 keeps the
# float32 BLAS path, for A/B runs of the agent (bench/quant.py compares the kernels themselves)
GEMM_INT8 = AVX2 and os.environ.get("EDGEPROBE_INT8_GEMM", "1") != "0"


def linear_w8a8_gemv_group(x: np.ndarray, scale_a: np.ndarray, part: np.ndarray, w: np.ndarray,
                           scale: np.ndarray) -> np.ndarray:
    """Sibling W8A8 linears reading one input (a layer's q, k and v; gate and up) as one decode call (numba only):
    x float32[M, K] (M <= GEMV_M); w int8[N1 + N2 + .., K] their row-major weights stacked; scale float32[N]
    (each row's scale_a * weight scale); part int32[N] which linear each row is; scale_a float32[P] each linear's
    activation scale -> float32[M, N], columns in w's order: each linear's columns are linear_w8a8_gemv's bits.
    One parallel region instead of P (a decode step is ~200 of them, each a fork and a join of the cores)."""
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    _linear_w8a8_group_nb(np.ascontiguousarray(x, np.float32), scale_a, part, np.ascontiguousarray(w), scale, y)
    return y


def linear_w8a8_gemv(x: np.ndarray, scale_a: float, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """A decode-sized W8A8 linear in one call: x float32[M, K] (M <= GEMV_M) quantized per tensor with scale_a
    (as quantize_per_tensor does), times w int8[N, K] (row-major) in exact int32, times scale float32[N]
    (scale_a * the weight's scale, per output channel or repeated) -> float32[M, N]: the bits of
    gemv_s8s32(quantize_per_tensor(x, scale_a), w).astype(float32) * scale. mllm-NPU §3.3 eq. 1's int8 part,
    without numpy's per-call overheads between the steps (a decode step runs 7 of these per layer)."""
    if numba is None:
        return gemv_s8s32(quantize_per_tensor(x, scale_a), w).astype(np.float32) * scale
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    _linear_w8a8_nb(np.ascontiguousarray(x, np.float32), np.float32(scale_a), np.ascontiguousarray(w), scale, y)
    return y


GEMV_M = 8  # up to this many rows (decode steps, small batches) the int8 row-dot kernel beats BLAS on float copies


def gemv_s8s32(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """a: int8[M, K] (M <= GEMV_M), w: int8[N, K] (row-major: output channel n's weights contiguous) -> int32[M, N],
    exact. Decode is memory-bound: this reads the int8 weights once (a quarter of a float32 copy's bytes), split
    over output channels across threads. Without numba (the agent on Termux): the exact BLAS path."""
    if numba is None:
        return gemm_s8s32(a, np.ascontiguousarray(w.T))
    c = np.empty((a.shape[0], w.shape[0]), np.int32)
    _gemv_s8s32_nb(np.ascontiguousarray(a), w, c)
    return c


# |sum of EXACT_K products| <= 1024 * 127 * 127 < 2^24: float32 holds every partial sum exactly
EXACT_K = 1024


def _check(a, bt):
    if a.dtype != np.int8 or bt.dtype != np.int8 or a.ndim != 2 or bt.ndim != 2 or a.shape[1] != bt.shape[0]:
        raise ValueError(f"gemm_s8s32 needs int8[M, K] and int8[K, N], got {a.dtype}{a.shape} and {bt.dtype}{bt.shape}")


def gemm_s8s32(a: np.ndarray, bt: np.ndarray, bt_f32: np.ndarray | None = None) -> np.ndarray:
    """a: int8[M, K], bt: int8[K, N] -> int32[M, N], exact: float32 BLAS over K-blocks of <= EXACT_K.

    Inputs must lie in [-127, 127] (symmetric quantization never produces -128). bt_f32: bt already cast to
    float32, kept by a caller that runs one weight many times (a decode GEMV is otherwise mostly the cast).
    """
    _check(a, bt)
    af = a.astype(np.float32)
    bf = bt.astype(np.float32) if bt_f32 is None else bt_f32
    if a.shape[1] <= EXACT_K:
        return gemm_exact_f32(af, bf).astype(np.int32)
    return gemm_blocked_f32(af, bf)


def gemm_codes_f32(af: np.ndarray, bf: np.ndarray) -> np.ndarray:
    """af float32[M, K], bf float32[K, N], both holding int8 values, any K -> float32[M, N] holding the exact int32
    sums (what a runner keeping its weight's float32 copy multiplies by its scales)."""
    return gemm_exact_f32(af, bf) if af.shape[1] <= EXACT_K else gemm_blocked_f32(af, bf).astype(np.float32)


def gemm_blocked_f32(af: np.ndarray, bf: np.ndarray) -> np.ndarray:
    """af float32[M, K], bf float32[K, N], both holding int8 values, any K -> int32[M, N], exact: K cut into
    equal blocks of <= EXACT_K (1536 -> 2 x 768: two even BLAS calls run faster than 1024 + 512)."""
    K = af.shape[1]
    step = -(-K // -(-K // EXACT_K))
    c = None
    for k0 in range(0, K, step):
        part = (af[:, k0:k0 + step] @ bf[k0:k0 + step]).astype(np.int32)
        c = part if c is None else np.add(c, part, out=c)
    return c


def gemm_exact_f32(af: np.ndarray, bf: np.ndarray) -> np.ndarray:
    """af float32[M, K], bf float32[K, N], both holding int8 values, K <= EXACT_K -> float32[M, N] holding the
    exact int32 sums (every partial sum is an integer below 2^24)."""
    return af @ bf if af.shape[0] > 32 else (bf.T @ af.T).T  # few rows: see linear_records.x_wt


def quantize_per_tensor_f32(x: np.ndarray, scale: float) -> np.ndarray:
    """quantize_per_tensor's int8 values as float32 (what the BLAS path multiplies), without the int8 round trip."""
    q = x / np.float32(scale)
    np.rint(q, out=q)
    return np.clip(q, -127, 127, out=q)


def gemm_s8s32_numba(a: np.ndarray, bt: np.ndarray) -> np.ndarray:
    """The integer-only kernel: numba, 4 rows of A per pass, int16 products accumulated in int32."""
    _check(a, bt)
    if numba is None:
        return gemm_s8s32_ref(a, bt)
    c = np.empty((a.shape[0], bt.shape[1]), np.int32)
    _gemm_s8s32_nb(np.ascontiguousarray(a), np.ascontiguousarray(bt), c)
    return c


def quantize_per_tensor(x: np.ndarray, scale: float) -> np.ndarray:
    """float -> int8: clip(round(x / scale), -127, 127) (symmetric, round half to even)."""
    return np.clip(np.rint(x / np.float32(scale)), -127, 127).astype(np.int8)
