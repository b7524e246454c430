"""Transformer primitives shared by the host's forward pass and the device agent (numpy, float32).

The host (`edgeprobe.forward`) and the agent's cpu lane run these same functions, so a plan executed
on the agent computes what the host simulates.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from . import threads as _threads
from .threads import POLICY, spread

try:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:
    numba = None

FEW_ROWS = 8  # up to this many rows (decode steps) the numba kernels below replace numpy's per-call overheads

LANES = 16  # partial sums of a row's squares: vertical adds, vectorized without fastmath's free reordering

# exp in float64 for the decode kernel's softmax (Cody & Waite's reduction by n ln 2, ln 2 in two parts as fdlibm
# splits it; Taylor to r^13 on |r| <= ln2 / 2, error below 2^-60): x = n ln2 + r, exp(x) = 2^n exp(r)
_LOG2E = 1.4426950408889634
_SHIFT = 6755399441055744.0  # 1.5 * 2^52: x log2e + _SHIFT holds round(x log2e) in its low bits
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # n * _LN2_HI exact for |n| < 2^21
_TAYLOR = tuple(1.0 / math.factorial(i) for i in range(14))

if numba is not None:
    @intrinsic
    def exp_f64(typingctx, x):
        """exp(x) for float64 x <= 709, within 1 ulp of the rounded exp; x < -708 gives 0 (a softmax weight below
        2^-1022 of the largest), NaN stays NaN. Written as LLVM IR of FMAs, integer adds and bitcasts: no libm call,
        so a loop over it vectorizes (numba's np.exp is a scalar call a key, ~10 ns: most of a decode step's
        attention), and no caller's fastmath can reassociate the reduction (an njit function doing the same inside
        the fastmath attention kernel lost its ln 2 split: 200 ulp at x = -700). The same bits on every CPU with FMA."""
        if x != types.float64:
            return None

        def codegen(context, builder, sig, args):
            f64, i64 = ir.DoubleType(), ir.IntType(64)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f64, [f64] * 3), "llvm.fma.f64")
            c = lambda v: ir.Constant(f64, v)
            x = args[0]
            kd = builder.call(fma, [x, c(_LOG2E), c(_SHIFT)])  # round-to-nearest n in the mantissa's low bits
            n = builder.fsub(kd, c(_SHIFT))
            r = builder.call(fma, [n, c(-_LN2_LO), builder.call(fma, [n, c(-_LN2_HI), x])])
            p = c(_TAYLOR[-1])
            for t in _TAYLOR[-2::-1]:
                p = builder.call(fma, [p, r, c(t)])
            bits = builder.shl(builder.add(builder.bitcast(kd, i64), ir.Constant(i64, 1023)), ir.Constant(i64, 52))
            e = builder.fmul(p, builder.bitcast(bits, f64))  # 2^n: n + 1023 in the exponent field
            return builder.select(builder.fcmp_unordered(">=", x, c(-708.0)), e, c(0.0))
        return types.float64(x), codegen

    # No fastmath: the sum's order is the code's (16 lanes, a tail, a fixed halving fold), so every compilation of
    # the kernel (each array type is one, cached by whichever process met it first) gives the same bits
    @numba.njit(nogil=True, cache=True)
    def _rms_norm_nb(x, w, eps, out):
        N, C = x.shape
        acc = np.empty(LANES, np.float32)
        for n in range(N):
            acc[:] = 0
            body = C - C % LANES
            for c0 in range(0, body, LANES):
                for j in range(LANES):
                    acc[j] += x[n, c0 + j] * x[n, c0 + j]
            for c in range(body, C):
                acc[c - body] += x[n, c] * x[n, c]
            h = LANES // 2
            while h > 0:
                for j in range(h):
                    acc[j] += acc[j + h]
                h //= 2
            ms = acc[0]
            r = np.float32(1.0 / np.sqrt(ms / C + eps))
            for c in range(C):
                out[n, c] = x[n, c] * r * w[c]

    @numba.njit(nogil=True, cache=True)
    def _rope_nb(x, cos, sin, out):
        B, T, H, d = x.shape
        for b in range(B):
            for t in range(T):
                for h in range(H):
                    for i in range(d // 2):
                        x0, x1, c, s = x[b, t, h, 2 * i], x[b, t, h, 2 * i + 1], cos[t, i], sin[t, i]
                        out[b, t, h, 2 * i] = x0 * c - x1 * s
                        out[b, t, h, 2 * i + 1] = x0 * s + x1 * c

    @numba.njit(nogil=True, cache=True)
    def _scale_rows_nb(x, r, w, out):
        """out = (x * r[:, None]) * w elementwise in x's float32, as numpy rounds it: rms_norm's tail on a block."""
        N, C = x.shape
        for n in range(N):
            for c in range(C):
                out[n, c] = x[n, c] * r[n] * w[c]

    @numba.njit(nogil=True, cache=True)
    def _add_nb(a, b, out):
        """out = a + b elementwise (float32): a residual add's block without the GIL."""
        N, C = a.shape
        for n in range(N):
            for c in range(C):
                out[n, c] = a[n, c] + b[n, c]

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def _attention_few_nb(q, k, v, S, start, window, scale, softcap, out):
        """attention() for a few query rows (decode): per query head, scores over the keys it sees, softmax,
        weighted sum of values, in one pass per head and no [rows, S] temporaries. k, v: C-contiguous
        [B, KV, >= S, d] (a KV cache read in place), positions S.. ignored. Computes in float64 like
        _attention_few_np (see there): its float32 output is the numpy path's, bit for bit (but for ~1e-8
        of elements; exp_f64 is within an ulp of numpy's float64 exp). scale: the scores' factor (float64);
        softcap > 0: scores become tanh(s / softcap) * softcap."""
        B, T, H, d = q.shape
        KV = k.shape[1]
        G = H // KV
        p = np.empty(S, np.float64)
        qs = np.empty(d, np.float64)
        o = np.empty(d, np.float64)
        for b in range(B):
            for t in range(T):
                pos = start + t
                lo = max(0, pos - window + 1) if window > 0 else 0
                hi = min(S, pos + 1)  # causal: keys after the query's own position are hidden
                for h in range(H):
                    g = h // G
                    for j in range(d):
                        qs[j] = np.float64(q[b, t, h, j])
                    mx = 0.0
                    for s in range(lo, hi):
                        acc = 0.0
                        for j in range(d):
                            acc += qs[j] * np.float64(k[b, g, s, j])
                        p[s] = acc * scale
                        if softcap > 0.0:
                            p[s] = np.tanh(p[s] / softcap) * softcap
                        mx = p[s] if s == lo else max(mx, p[s])
                    tot = 0.0
                    ps = p[lo:hi]  # from 0: numba vectorizes no loop that indexes from lo (negative-index wrap)
                    for s in range(hi - lo):
                        e = exp_f64(ps[s] - mx)
                        ps[s] = e
                        tot += e
                    o[:] = 0.0
                    for s in range(lo, hi):
                        w = p[s] / tot
                        for j in range(d):
                            o[j] += w * np.float64(v[b, g, s, j])
                    for j in range(d):
                        out[b * T + t, h * d + j] = np.float32(o[j])

    # A prompt block's softmax (_attention_block) in three passes instead of numpy's eight over [rows, keys]
    # (the mask's temporaries, max, subtract, sum, divide: max-subtract alone took 41 of a 64-token layer's 154 us):
    # the mask and the max-subtract here, numpy's own float32 exp between, the row sums in numpy's pairwise order
    # and the divide here. Each step is numpy's arithmetic: the same bits. (From ~1024 keys the block's two BLAS
    # products take most of its time.)
    @numba.njit(nogil=True, cache=True)
    def _mask_max_sub_nb(s, R, b0, window):
        """s float32[N, end]: rows i of query position b0 + i % R (a block's G*R rows a KV head, as
        _attention_block lays them out) over keys 0..end-1 -> keys it does not see (after it; window > 0: at or
        before pos - window) -inf, the rest minus the row's max, in place."""
        for i in range(s.shape[0]):
            row = s[i]
            pos = b0 + i % R
            lo = max(0, pos - window + 1) if window > 0 else 0
            for c in range(lo):
                row[c] = -np.inf
            tail = row[pos + 1:]
            for c in range(tail.shape[0]):
                tail[c] = -np.inf
            seen = row[lo:pos + 1]
            m = seen[0]
            for c in range(seen.shape[0]):
                m = max(m, seen[c])
            for c in range(seen.shape[0]):
                seen[c] = seen[c] - m

    @numba.njit(nogil=True, cache=True)
    def _block_sum_nb(b):
        """numpy's pairwise sum of float32 b[:n], n <= 128: 8 float32 partial sums, then the rest. Indexed from 0
        over a slice: an index from a variable start took numba's negative-index wrap on every read (2x slower)."""
        n = b.shape[0]
        if n < 8:
            res = np.float32(-0.0)
            for i in range(n):
                res += b[i]
            return res
        r0, r1, r2, r3, r4, r5, r6, r7 = b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
        body = n - n % 8
        for i in range(8, body, 8):
            r0 += b[i]
            r1 += b[i + 1]
            r2 += b[i + 2]
            r3 += b[i + 3]
            r4 += b[i + 4]
            r5 += b[i + 5]
            r6 += b[i + 6]
            r7 += b[i + 7]
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        for i in range(body, n):
            res += b[i]
        return res

    @numba.njit(nogil=True, cache=True)
    def _pairwise_sum_nb(a, n, todo, sums):
        """numpy's pairwise sum of float32 a[:n] (its add.reduce over a contiguous axis): blocks of <= 128 as
        _block_sum_nb, longer spans halved at a multiple of 8, each span's sum its halves' float32 sum: the same
        bits. Without recursion (numba's cache of a recursive function crashed on load): todo int64[64, 3] and
        sums float32[64] are scratch, a stack of (start, length, halves done) and one of finished sums."""
        if n <= 128:
            return _block_sum_nb(a[:n])
        top, done = 0, 0
        todo[0, 0], todo[0, 1], todo[0, 2] = 0, n, 0
        while top >= 0:
            lo, m, halves = todo[top, 0], todo[top, 1], todo[top, 2]
            if m <= 128:
                sums[done] = _block_sum_nb(a[lo:lo + m])
                done += 1
                top -= 1
                continue
            h = m // 2
            h -= h % 8
            if halves == 2:  # both halves summed: left + right, as numpy returns them
                sums[done - 2] = sums[done - 2] + sums[done - 1]
                done -= 1
                top -= 1
                continue
            todo[top, 2] = halves + 1
            top += 1
            todo[top, 0], todo[top, 1], todo[top, 2] = (lo, h, 0) if halves == 0 else (lo + h, m - h, 0)
        return sums[0]

    @numba.njit(nogil=True, cache=True)
    def _divide_by_sums_nb(s):
        """s float32[N, C]: each row divided by its numpy sum, in place (scores /= scores.sum(-1, keepdims=True))."""
        todo, sums = np.empty((64, 3), np.int64), np.empty(64, np.float32)
        for i in range(s.shape[0]):
            row = s[i]
            # a row of <= 128 keys straight to its block sum: through _pairwise_sum_nb's call it took 2x as long
            t = _block_sum_nb(row) if row.shape[0] <= 128 else _pairwise_sum_nb(row, row.shape[0], todo, sums)
            for c in range(row.shape[0]):
                row[c] = row[c] / t


def _attention_few_np(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int, scale: float,
                      softcap: float = 0.0) -> np.ndarray:
    """attention() for a few query rows (decode) without numba, computed as _attention_few_nb does: in float64,
    rounded to float32 once at the end. The host (numba) and an agent without numba (a phone) must produce the
    same bits here, not just close ones: W8A8's per-tensor activation quantization turns a one-ulp difference in
    attn_output's input into a whole int8 code step, and decode logits then drift (cosine ~0.99). Products of
    float32 numbers are exact in float64 and float64 sums differ by ~1e-16 between summation orders (BLAS,
    numba's vectorized loops), so the rounded float32 results agree bit for bit except where a result lies within
    ~1e-16 of a float32 rounding boundary (about 1e-8 of elements; float32 sums in other orders differ in many).
    k, v: [B, KV, >= start + T, d]."""
    B, T, H, d = q.shape
    KV, S = k.shape[1], start + T
    G = H // KV
    lo = max(0, start - window + 1) if window > 0 else 0  # keys before lo are hidden from every query row
    kk = k[:, :, lo:S].astype(np.float64)
    vv = v[:, :, lo:S].astype(np.float64)
    qg = q.transpose(0, 2, 1, 3).reshape(B, KV, G * T, d).astype(np.float64)
    scores = np.matmul(qg, kk.swapaxes(-1, -2)) * scale  # [B, KV, G*T, S - lo]
    if softcap > 0:
        scores = np.tanh(scores / softcap) * softcap
    pos, keys = (start + np.arange(T))[:, None], np.arange(lo, S)[None, :]
    hidden = (keys > pos) | ((keys <= pos - window) if window > 0 else False)
    if hidden.any():
        scores.reshape(B, KV, G, T, S - lo)[...] += np.where(hidden, -np.inf, 0.0)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, vv).astype(np.float32)  # [B, KV, G*T, d]
    return out.reshape(B, H, T, d).transpose(0, 2, 1, 3).reshape(B * T, H * d)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: float32[N, C], w: float32[C] -> x / rms(x) * w (RMSNorm, Zhang & Sennrich 2019)."""
    if numba is not None and x.shape[0] <= FEW_ROWS and x.dtype == np.float32 and w.dtype == np.float32:
        out = np.empty(x.shape, np.float32)
        _rms_norm_nb(np.ascontiguousarray(x), w, np.float32(eps), out)
        return out
    nb = numba is not None and x.dtype == w.dtype == np.float32
    whole = x.ndim != 2 or x.shape[0] < SPLIT_ROWS or not _threads.ROW_SPLITS
    if whole and not (nb and x.ndim == 2):
        return x * _rms_np(x, eps)[:, None] * w
    out = np.empty(x.shape, np.result_type(x, w, np.float32))  # the numpy form's type (1/rms is float32)

    def rows(blocks):
        for a, b in blocks:
            if nb:  # numpy's sums of squares (einsum, GIL released), the scaling in numba: numpy's bits
                _scale_rows_nb(x[a:b], _rms_np(x[a:b], eps), w, out[a:b])
            else:
                out[a:b] = x[a:b] * _rms_np(x[a:b], eps)[:, None] * w
    if whole:
        rows([(0, x.shape[0])])  # one block in numba (64 x 576: 18 -> 9 us here)
    else:
        _blocks(rows, x.shape[0], x.size)
    return out


def _rms_np(x: np.ndarray, eps: float) -> np.ndarray:
    """float32[N]: 1 / rms of each row of x as rms_norm's numpy form computes it (each row's sum of squares alone:
    einsum's order depends on the row's length only)."""
    ms = np.einsum("nc,nc->n", x, x) / x.shape[1]
    return (1.0 / np.sqrt(ms + eps)).astype(np.float32)


def rope_tables(head_dim: int, theta: float, start: int, length: int, factors=None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: float32[length, head_dim/2] for positions start..start+length-1 (RoFormer eq. 34).
    factors: float[head_dim/2] dividing each frequency (Llama 3's RoPE scaling, llama.cpp's rope_freqs)."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if factors is not None and len(factors):
        inv_freq = inv_freq / np.asarray(factors, np.float64)
    ang = np.arange(start, start + length, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: float32[B, T, heads, head_dim], rotating adjacent pairs (2i, 2i+1) — the GGUF layout."""
    B, T, H, d = x.shape
    if numba is not None and B * T <= FEW_ROWS and x.dtype == np.float32:
        out = np.empty(x.shape, np.float32)
        _rope_nb(x, cos, sin, out)
        return out
    out = np.empty((B, T, H, d // 2, 2), x.dtype)
    split = T >= SPLIT_ROWS and _threads.ROW_SPLITS
    # numba at any row count: numpy's strided pairs cost ~3 ns an element (a 64-token prompt's q: 108 us, 6x)
    nb = numba is not None and x.dtype == cos.dtype == sin.dtype == np.float32
    o4 = out.reshape(B, T, H, d)

    def positions(blocks):  # elementwise: any cut of the positions gives the same bits (numba's too: tested)
        for a, b in blocks:
            if nb:  # no GIL held: blocks on two threads run side by side
                _rope_nb(x[:, a:b], cos[a:b], sin[a:b], o4[:, a:b])
                continue
            xp = x[:, a:b].reshape(B, b - a, H, d // 2, 2)
            x0, x1 = xp[..., 0], xp[..., 1]
            c, s = cos[None, a:b, None, :], sin[None, a:b, None, :]
            out[:, a:b, ..., 0] = x0 * c - x1 * s
            out[:, a:b, ..., 1] = x0 * s + x1 * c
    if split:
        _blocks(positions, T, x.size)
    else:
        positions([(0, T)])
    return o4


ATTN_BLOCK = 64  # positions per block of a prompt's attention (query rows; keys padded to the block's end)
SPLIT_ROWS = 256  # from this many rows an elementwise op is worth splitting over the op's cores
# A context manager factory under which the op's BLAS calls run on one thread, set by the agent (threads.py), or
# None: ops never split. Two parts each calling 2-thread BLAS ran attention 2-3x slower; and outside the agent
# OpenBLAS's idle worker spins ~0.1 s after each call (the agent shortens it), taking the core a part would use.
SPLIT_HOOK = None


def _op_cores() -> int:
    """The cores the calling thread's op may use: numba's thread count for this thread, which the agent sets per
    op (1 when another lane computes, all when the op computes alone: edgeprobe_agent/threads.py); 1 without numba."""
    return numba.get_num_threads() if numba is not None else 1


def _split(fn, items: list) -> None:
    """fn(part) over items dealt into one part per core the op may use (threads.spread: the calling thread runs the
    first part, pool threads the others): in the agent the cores its split hook allows, in a host pass the pass's
    threads (BLAS already runs one thread a call there). Dealt back and forth (0 1 1 0 0 1 ...): items whose cost
    grows along the list (causal attention's blocks) fall evenly. Each part writes its own rows, so the result is
    the same bits as fn(items)."""
    hook = SPLIT_HOOK
    n = min(_op_cores() if hook is not None else POLICY.width, len(items))
    if n < 2:
        fn(items)
        return
    parts = [[] for _ in range(n)]
    for i, item in enumerate(items):
        j = i % (2 * n)
        parts[j if j < n else 2 * n - 1 - j].append(item)
    with hook() if hook is not None else contextlib.nullcontext():
        spread(fn, parts)


# about this many rows a block of a split row-wise op: past FEW_ROWS (each block takes numpy's path); its
# temporaries stay in cache, so blocks run ~1.5-2.5x faster than the whole op even on one thread (RoPE, adds)
ROW_BLOCK = 128
# from this many elements a cheap row-wise op (norm, RoPE, add) spreads its blocks over the threads; below, waking
# the pool (~30 us) and the GIL's hand-offs cost more than a second core saves (512 x 576: 0.13-0.23 ms on one)
SPREAD_ELEMENTS = 1 << 20


def _blocks(fn, n: int, elements: int) -> None:
    """fn(row_blocks(n)) on the calling thread, or its blocks _split over the op's cores from SPREAD_ELEMENTS."""
    if elements >= SPREAD_ELEMENTS:
        _split(fn, row_blocks(n))
    else:
        fn(row_blocks(n))


def row_blocks(n: int) -> list[tuple[int, int]]:
    """The fixed (start, stop) row blocks of a row-wise op over n rows: a function of n alone (at most 16)."""
    nb = max(1, min(16, n // ROW_BLOCK))
    edges = [round(n * i / nb) for i in range(nb + 1)]
    return list(zip(edges[:-1], edges[1:]))


def add(a: np.ndarray, *others: np.ndarray) -> np.ndarray:
    """a + others[0] + ... in a's dtype, summed left to right (a residual add): float32 of equal shapes in numba
    (the same IEEE sums, no copy first, no GIL held), in row blocks from SPLIT_ROWS rows (_blocks: over the op's
    cores from SPREAD_ELEMENTS)."""
    nb = numba is not None and a.ndim == 2 and bool(others) and \
        all(b.shape == a.shape and b.dtype == np.float32 for b in (a, *others))
    if not nb:
        out = a.copy()
        for b in others:
            out += b
        return out
    out = np.empty(a.shape, np.float32)

    def rows(blocks):
        for r0, r1 in blocks:
            o = out[r0:r1]
            _add_nb(a[r0:r1], others[0][r0:r1], o)
            for b in others[1:]:
                _add_nb(o, b[r0:r1], o)
    if a.shape[0] < SPLIT_ROWS or not _threads.ROW_SPLITS:
        rows([(0, a.shape[0])])  # one block (4 -> 2.6 us at 64 x 576 here)
    else:
        _blocks(rows, a.shape[0], a.size)
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int = 0, scale: float = 0.0,
              softcap: float = 0.0) -> np.ndarray:
    """Causal grouped-query attention, optionally over a sliding window (Gemma 3's local layers).

    q: float32[B, T, n_heads, d] at positions start..start+T-1; k, v: float32[B, n_kv, >= S, d], S = start + T:
    a KV cache may be passed whole (positions S.. are ignored; decode reads it in place, no copy of its prefix).
    Query head h reads KV head h // (n_heads / n_kv). window > 0: the query at position i sees keys
    i - window + 1..i only. scale: the scores' factor, 0 for 1/sqrt(d) (Gemma: 1/sqrt(query_pre_attn_scalar));
    softcap > 0: scores become tanh(s / softcap) * softcap before the mask (Gemma 2). Returns float32[B*T, n_heads*d].
    """
    B, T, H, d = q.shape
    S = start + T
    if k.shape[2] < S or v.shape[2] < S:
        raise ValueError(f"attention at positions {start}..{S - 1} needs {S} keys and values, "
                         f"got {k.shape[2]}, {v.shape[2]}")
    # few query rows a sequence (T, not B * T): a batch of N decode steps takes the decode kernel at any N, where
    # the blocks below would compute ATTN_BLOCK query rows for each sequence's one (batch 16: ~10x the step)
    if numba is not None and T <= FEW_ROWS and q.dtype == k.dtype == v.dtype == np.float32:
        out = np.empty((B * T, H * d), np.float32)
        # numba vectorizes contiguous rows only: a whole cache is; a strided prefix view is copied
        kc = k if k.flags.c_contiguous else np.ascontiguousarray(k[:, :, :S])
        vc = v if v.flags.c_contiguous else np.ascontiguousarray(v[:, :, :S])
        _attention_few_nb(np.ascontiguousarray(q), kc, vc, S, start, window, _scale64(d, scale), float(softcap), out)
        return out
    if T <= FEW_ROWS and q.dtype == k.dtype == v.dtype == np.float32:  # the kernel's float64 arithmetic: same bits
        return _attention_few_np(q, k, v, start, window, _scale64(d, scale), float(softcap))
    k, v = k[:, :, :S], v[:, :, :S]
    first, last = start // ATTN_BLOCK, (S - 1) // ATTN_BLOCK
    if first == last:
        hook = SPLIT_HOOK  # in the agent, BLAS on one thread: its sleeping worker woke for each small GEMM (~6)
        with hook() if hook is not None else contextlib.nullcontext():  # 64 tokens: ~600 -> ~450 us here
            return _attention_block(q, k, v, start, window, scale, softcap).reshape(B * T, H * d)
    out = np.empty((B, T, H * d), np.float32)

    def blocks(b0s):  # the blocks are independent: split over the op's cores (softmax is numpy, one thread each)
        for b in b0s:
            p0, p1 = max(start, b * ATTN_BLOCK), min(S, (b + 1) * ATTN_BLOCK)
            out[:, p0 - start:p1 - start] = _attention_block(q[:, p0 - start:p1 - start], k, v, p0, window, scale,
                                                             softcap)
    _split(blocks, list(range(first, last + 1)))
    return out.reshape(B * T, H * d)


def _scale64(d: int, scale: float) -> float:
    """The scores' factor in float64: 1/sqrt(d) unless the model gives its own."""
    return float(scale) if scale else 1.0 / np.sqrt(np.float64(d))


def _attention_block(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int, scale: float = 0.0,
                     softcap: float = 0.0) -> np.ndarray:
    """attention() for query rows at positions start..start+T-1 inside one block of ATTN_BLOCK positions, aligned
    at absolute positions: scores over keys 0..end-1, end the block's end, keys past the prompt zeros (masked).
    A query row's arithmetic then depends on its position alone, not on where a chunked prefill cut the prompt:
    BLAS sums a product's inner dimension in an order that changes with its length on some CPUs (OpenBLAS's
    SkylakeX kernels) and with its number of rows on others (AMD EPYC's), and per-tensor int8 downstream turns a
    changed last bit into a whole code step: so every block computes all its ATTN_BLOCK query rows (zeros outside
    start..start+T-1) and keeps its own. k, v: [B, KV, >= start + T, d] -> float32[B, T, H*d]. The G query heads
    of a KV head share its keys: one GEMM of M = G*ATTN_BLOCK rows per KV head."""
    B, T, H, d = q.shape
    KV, S = k.shape[1], start + T
    G = H // KV
    end = -(-S // ATTN_BLOCK) * ATTN_BLOCK
    b0, R = end - ATTN_BLOCK, ATTN_BLOCK  # the block's every query row: each GEMM has one shape (sums vary with M)
    if end > S:  # zeros, not whatever a KV cache holds there: 0 * inf would be nan
        k, v = (np.concatenate([a[:, :, :S], np.zeros((B, KV, end - S, d), a.dtype)], axis=2) for a in (k, v))
    else:
        k, v = k[:, :, :end], v[:, :, :end]
    rows = q
    if T < R:
        rows = np.zeros((B, R, H, d), q.dtype)
        rows[:, start - b0:S - b0] = q
    qg = rows.transpose(0, 2, 1, 3).reshape(B, KV, G * R, d) * np.float32(scale or 1.0 / np.sqrt(d))
    scores = np.matmul(qg, k.swapaxes(-1, -2))  # [B, KV, G*R, end]
    if softcap:
        scores = np.tanh(scores / np.float32(softcap)) * np.float32(softcap)
    if numba is not None and scores.dtype == np.float32:  # numpy's arithmetic in fewer passes (_mask_max_sub_nb)
        rows2 = scores.reshape(-1, end)
        _mask_max_sub_nb(rows2, R, b0, window)
        np.exp(rows2, out=rows2)
        _divide_by_sums_nb(rows2)
    else:
        lo = 0 if window else b0  # without a window every query sees keys 0..b0-1: mask only the block's own
        pos, keys = (b0 + np.arange(R))[:, None], np.arange(lo, end)[None, :]
        hidden = (keys > pos) | ((keys <= pos - window) if window else False)
        scores.reshape(B, KV, G, R, end)[..., lo:] += np.where(hidden, -np.inf, 0.0).astype(np.float32)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v)  # [B, KV, G*R, d]
    return out.reshape(B, H, R, d).transpose(0, 2, 1, 3)[:, start - b0:S - b0].reshape(B, T, H * d)


def swiglu_act(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u: the input of an FFN's down projection (Shazeer 2020). Rows split over the op's cores from
    SPLIT_ROWS rows (numpy's float32 exp is ~1.8 ns an element here, 0.2 s of a 1024-token prefill)."""
    if g.ndim != 2 or g.shape != u.shape or g.shape[0] <= FEW_ROWS:  # decode: KB temporaries, one call fewer
        return g / (1.0 + np.exp(-g)) * u
    out = np.empty(g.shape, np.result_type(g, u))
    if g.shape[0] < SPLIT_ROWS:
        _silu_mul(g, u, out)
        return out
    step = -(-g.shape[0] // 8)

    def rows(r0s):
        for r0 in r0s:
            _silu_mul(g[r0:r0 + step], u[r0:r0 + step], out[r0:r0 + step])
    _split(rows, list(range(0, g.shape[0], step)))
    return out


def _silu_mul(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    """out = g / (1.0 + np.exp(-g)) * u, the same ufuncs in the same order (the same bits) on one temporary
    instead of four: a 64 x 1536 block in ~180 us where the expression took ~230-350 (tests/test_fast_paths.py)."""
    t = np.negative(g)
    np.exp(t, out=t)
    t += 1.0
    np.divide(g, t, out=t)
    np.multiply(t, u, out=out)


def geglu_act(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gelu_tanh(g) * u: GeGLU (Shazeer 2020) with GELU's tanh approximation, as Gemma computes it."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return (np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + np.float32(0.044715) * g * g * g)))) * u


def llama3_freq_factors(head_dim: int, theta: float, factor: float, low: float, high: float, original: int):
    """Llama 3.1's RoPE scaling as per-frequency divisors: long wavelengths slowed by `factor`, short ones kept,
    a smooth ramp between (wavelengths original/high .. original/low)."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / inv
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    scaled = (1 - smooth) * inv / factor + smooth * inv
    return inv / scaled


GATED_ACTS = {"silu": swiglu_act, "gelu_tanh": geglu_act}  # the FFN gate activations, by ModelConfig.act_fn


def head_rms_norm(x: np.ndarray, w: np.ndarray, eps: float, head_dim: int) -> np.ndarray:
    """x: float32[N, heads * head_dim], RMSNorm of each head's slice with w float32[head_dim] (q/k norm)."""
    n = x.shape[0]
    return rms_norm(x.reshape(-1, head_dim), w, eps).reshape(n, -1)


def route(logits: np.ndarray, k: int, norm_topk: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Softmax router with top-k (Shazeer et al. 2017; Mixtral, OLMoE, Qwen-MoE).

    logits float32[N, E] -> experts int64[N, k] (highest probability first, ties to the lower index),
    weights float32[N, k]: the softmax probabilities of the chosen experts, renormalized to sum to 1
    when `norm_topk` (Mixtral, OLMoE with norm_topk_prob) or left as they are (Qwen1.5-MoE).
    """
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    experts = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, experts, axis=1)
    if norm_topk:
        w = w / w.sum(axis=1, keepdims=True)
    return experts.astype(np.int64), w.astype(np.float32)


def mix_experts(x: np.ndarray, experts: np.ndarray, weights: np.ndarray, expert) -> np.ndarray:
    """The routed experts' outputs mixed by their router weights (EdgeMoE §3.3: each expert sees only its rows).

    x float32[N, hidden], experts int64[N, k] and weights float32[N, k] (route's); expert(e, rows of x) ->
    float32[rows, hidden]. Experts run in ascending order; a token picks an expert at most once, so its rows are
    unique and += is a scatter-add. -> float32[N, hidden]."""
    y = np.zeros_like(x)
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)
        y[rows] += weights[rows, slot, None] * expert(int(e), x[rows])
    return y
