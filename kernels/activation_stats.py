"""Streaming per-channel activation statistics: numba kernels, each beside its numpy reference.

Used by edgeprobe's profilers (mllm-NPU §3.3 outliers; LLM in a flash §3 sliding window). The
outlier kernel makes one pass over an activation and releases the GIL; the sliding-window counts
work on packed activity bits, 64 neurons per numpy operation. The references define what they
compute and the tests hold the fast versions to them.
"""
from __future__ import annotations

import math

import numpy as np

from . import threads
from .threads import column_blocks, run_blocks

try:
    import numba
except ImportError:  # a phone without numba falls back to the references
    numba = None

# Bins of |x| / clip: [<1/2) (implicit), [1/2,1), [1,2), [2,4), ..., [2^(N_RATIO_BINS-2), inf)
N_RATIO_BINS = 12
RATIO_EDGES = 2.0 ** np.arange(-1, N_RATIO_BINS - 1)  # lower edges of bins 0..N-1


def outlier_update_ref(x, clip, fixed, chmax, count, count_fixed, hist, tok_hist, any_out):
    """Accumulate one activation into per-channel outlier statistics (all arrays updated in place).

    x: float32[N, C]; clip: float, the per-tensor clip value (int8 scale * 127): |x| > clip is an
    outlier (mllm-NPU eq. 1); fixed: float, LLM.int8()'s absolute threshold (6.0).
    chmax float32[C] running max |x|; count / count_fixed int64[C] values beyond clip / fixed;
    hist int64[C, N_RATIO_BINS] counts of |x|/clip per RATIO_EDGES bin (values < 1/2 not counted);
    tok_hist int64[C+1] tokens by their number of outlier channels; any_out bool[C] (|=).
    """
    a = np.abs(x)
    np.maximum(chmax, a.max(axis=0), out=chmax)
    out = a > clip
    count += out.sum(axis=0)
    count_fixed += (a > fixed).sum(axis=0)
    r = a / clip
    b = np.clip(np.floor(np.log2(np.maximum(r, 1e-30))).astype(np.int64) + 1, 0, N_RATIO_BINS - 1)
    C = x.shape[1]
    keep = r >= 0.5
    np.add.at(hist, (np.nonzero(keep)[1], b[keep]), 1)
    tok_hist += np.bincount(out.sum(axis=1), minlength=C + 1)
    any_out |= out.any(axis=0)


NEVER = -(1 << 62)  # `last` value of a neuron that has not fired in this sequence


def window_update_ref(act, tau, last, t0, K, fire, gap_hist, age_hist):
    """Sliding-window neuron residency over one sequence's tokens, in order (LLM in a flash §3.2).

    act: float32[N, F], activations of tokens t0..t0+N-1; neuron j is active when |act| > tau.
    last: int64[F] sequence position at which each neuron last fired (NEVER at the start of a
    sequence), updated; K: the largest window. fire int64[F] += firings.
    gap_hist int64[K+2]: for each firing, position - last[j] capped at K+1: a firing is a new load
    for window k iff its gap > k. age_hist int64[K+2]: for each token and neuron, position - last[j]
    after the update, capped at K+1: the neuron is resident in window k iff age < k.
    """
    active = np.abs(act) > tau
    N, F = active.shape
    for t in range(N):
        pos = t0 + t
        idx = np.nonzero(active[t])[0]
        fire[idx] += 1
        gap_hist += np.bincount(np.clip(pos - last[idx], 0, K + 1), minlength=K + 2)
        last[idx] = pos
        age_hist += np.bincount(np.clip(pos - last, 0, K + 1), minlength=K + 2)


if numba is not None:
    @numba.njit(nogil=True, cache=True)
    def _ratio_bin(a, clip):
        """The RATIO_EDGES bin of |x| = a (float32) over clip (float64): a/clip = m * 2^e, m in [0.5, 1), so
        floor(log2) = e - 1, bin e. One definition for outlier_update and replay_outliers."""
        return min(max(math.frexp(a / clip)[1], 0), N_RATIO_BINS - 1)

    @numba.njit(nogil=True, cache=True)
    def _outlier_cols_nb(x, c0, c1, clip, fixed, chmax, count, count_fixed, hist, any_out, k):
        """outlier_update_ref's channel statistics over channels c0..c1-1 alone; k int64[N] += each row's outliers
        among them (the token histogram is made from the blocks' sums)."""
        N = x.shape[0]
        half = 0.5 * clip
        rare = min(half, fixed)
        for n in range(N):
            kn = 0
            for c in range(c0, c1):
                a = abs(x[n, c])
                chmax[c] = max(chmax[c], a)
                if a >= rare:
                    if a > fixed:
                        count_fixed[c] += 1
                    if a >= half:
                        hist[c, _ratio_bin(a, clip)] += 1
                        if a > clip:
                            count[c] += 1
                            any_out[c] = True
                            kn += 1
            k[n] += kn

    @numba.njit(nogil=True, cache=True)
    def _outlier_update_nb(x, clip, fixed, chmax, count, count_fixed, hist, tok_hist, any_out):
        """outlier_update_ref over all channels: _outlier_cols_nb in one block, then the token histogram."""
        k = np.zeros(x.shape[0], np.int64)
        _outlier_cols_nb(x, 0, x.shape[1], clip, fixed, chmax, count, count_fixed, hist, any_out, k)
        for n in range(x.shape[0]):
            tok_hist[k[n]] += 1

    @numba.njit(nogil=True, cache=True)
    def _keep_above_nb(x, r0, r1, t, fixed, chmax, count_fixed):
        """keep_above_ref over rows r0..r1-1: (flat indices n * C + c int32[k], |x| float32[k]), row-major."""
        C = x.shape[1]
        k = 0
        for n in range(r0, r1):
            for c in range(C):
                a = abs(x[n, c])
                chmax[c] = max(chmax[c], a)
                if a > fixed:
                    count_fixed[c] += 1
                if a >= t:
                    k += 1
        # sized by a count first: allocating for every entry (8 bytes each, ~1% kept) and copying out cost more than
        # reading the rows twice (512 x 1536 in 8 blocks, one thread: 2.0 -> 1.5 ms)
        idx = np.empty(k, np.int32)
        vals = np.empty(k, np.float32)
        k = 0
        for n in range(r0, r1):
            for c in range(C):
                a = abs(x[n, c])
                if a >= t:
                    idx[k] = n * C + c
                    vals[k] = a
                    k += 1
        return idx, vals

    @numba.njit(nogil=True, cache=True)
    def _replay_nb(idx, vals, rows, C, clip, count, hist, tok_hist, any_out):
        """replay_outliers_ref with _outlier_cols_nb's arithmetic (the same comparisons and _ratio_bin)."""
        k = np.zeros(rows, np.int64)
        half = 0.5 * clip
        for i in range(idx.size):
            a = vals[i]
            if a >= half:
                c = idx[i] % C
                hist[c, _ratio_bin(a, clip)] += 1
                if a > clip:
                    count[c] += 1
                    any_out[c] = True
                    k[idx[i] // C] += 1
        for n in range(rows):
            tok_hist[k[n]] += 1

    @numba.njit(nogil=True, cache=True)
    def _log2_hist_nb(bits, out):
        for i in range(bits.size):
            out[(bits[i] & 0x7FFFFFFF) >> 18] += 1


SPLIT_ROWS = 256  # from this many rows a statistic is worth splitting over a host pass's threads


def _blocked(rows: int) -> bool:
    """Whether a statistic over `rows` rows runs in blocks (run_blocks: over a host pass's threads, else inline)."""
    return numba is not None and rows >= SPLIT_ROWS and threads.ROW_SPLITS


def outlier_update(x, clip, fixed, chmax, count, count_fixed, hist, tok_hist, any_out):
    """See outlier_update_ref; numba when available and x is C-contiguous float32. From SPLIT_ROWS rows the channels
    are cut into fixed blocks (threads.column_blocks) spread over a host pass's threads: each block updates its own
    channels, the token histogram comes from the blocks' integer per-row counts, so the state is the one-block
    state exactly."""
    C = x.shape[1]
    if hist.shape != (C, N_RATIO_BINS) or tok_hist.shape != (C + 1,) or chmax.shape != (C,):
        raise ValueError(f"outlier_update: state arrays do not match {C} channels")
    if numba is None or x.dtype != np.float32 or not x.flags.c_contiguous:
        return outlier_update_ref(x, clip, fixed, chmax, count, count_fixed, hist, tok_hist, any_out)
    if not _blocked(x.shape[0]):
        _outlier_update_nb(x, float(clip), float(fixed), chmax, count, count_fixed, hist, tok_hist, any_out)
        return
    blocks = column_blocks(C)
    k = np.zeros((len(blocks), x.shape[0]), np.int64)  # each block's outliers per row: summed, they are the row's
    index = {a: i for i, (a, _) in enumerate(blocks)}

    def block(a, b):
        _outlier_cols_nb(x, a, b, float(clip), float(fixed), chmax, count, count_fixed, hist, any_out, k[index[a]])
    run_blocks(block, blocks)
    tok_hist += np.bincount(k.sum(axis=0), minlength=C + 1)


def keep_above_ref(x, t, fixed, chmax, count_fixed):
    """The part of outlier_update that needs no clip, plus the entries a later clip can count.

    x: float32[N, C]; t: keep the entries with |x| >= t; fixed: LLM.int8()'s threshold. chmax float32[C] and
    count_fixed int64[C] are updated as outlier_update updates them. Returns (flat index n * C + c int32[k], |x|
    float32[k]) of the kept entries in row-major order: replay_outliers turns them into the clip's statistics.
    """
    a = np.abs(x)
    np.maximum(chmax, a.max(axis=0), out=chmax)
    count_fixed += (a > fixed).sum(axis=0)
    flat = np.flatnonzero(a >= t)
    return flat.astype(np.int32), a.ravel()[flat]


def replay_outliers_ref(idx, vals, rows, C, clip, count, hist, tok_hist, any_out):
    """outlier_update's clip statistics (count, hist, tok_hist, any_out) of an activation of `rows` x C entries from
    keep_above's (idx, vals) of it: the same state whenever every entry with |x| >= clip / 2 was kept."""
    n, c = idx // C, idx % C
    r = vals / clip  # float32 / float, as outlier_update_ref's
    b = np.clip(np.floor(np.log2(np.maximum(r, 1e-30))).astype(np.int64) + 1, 0, N_RATIO_BINS - 1)
    keep = r >= 0.5
    np.add.at(hist, (c[keep], b[keep]), 1)
    out = vals > clip
    count += np.bincount(c[out], minlength=C)
    tok_hist += np.bincount(np.bincount(n[out], minlength=rows), minlength=C + 1)
    any_out[c[out]] = True


KEEP_PARTS = 8  # keep_above's fixed row blocks (as log2_histogram's)


def keep_above(x, t, fixed, chmax, count_fixed):
    """See keep_above_ref; numba when available. From SPLIT_ROWS rows, KEEP_PARTS fixed row blocks spread over a host
    pass's threads, each with its own maxima and counts (combined after: the same state) and entries (concatenated
    in block order: the same row-major order)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    C = x.shape[1]
    if chmax.shape != (C,) or count_fixed.shape != (C,):
        raise ValueError(f"keep_above: state arrays do not match {C} channels")
    if numba is None:
        return keep_above_ref(x, t, fixed, chmax, count_fixed)
    rows = x.shape[0]
    if not _blocked(rows):
        return _keep_above_nb(x, 0, rows, float(t), float(fixed), chmax, count_fixed)
    edges = [round(rows * i / KEEP_PARTS) for i in range(KEEP_PARTS + 1)]
    mx, cf = np.zeros((KEEP_PARTS, C), np.float32), np.zeros((KEEP_PARTS, C), np.int64)
    parts = [None] * KEEP_PARTS

    def block(i, j):
        for p in range(i, j):
            parts[p] = _keep_above_nb(x, edges[p], edges[p + 1], float(t), float(fixed), mx[p], cf[p])
    run_blocks(block, [(p, p + 1) for p in range(KEEP_PARTS)])
    np.maximum(chmax, mx.max(axis=0), out=chmax)
    count_fixed += cf.sum(axis=0)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def replay_outliers(idx, vals, rows, C, clip, count, hist, tok_hist, any_out):
    """See replay_outliers_ref; numba when available (the arithmetic of outlier_update's kernel)."""
    if hist.shape != (C, N_RATIO_BINS) or tok_hist.shape != (C + 1,) or count.shape != (C,):
        raise ValueError(f"replay_outliers: state arrays do not match {C} channels")
    if numba is None:
        return replay_outliers_ref(idx, vals, rows, C, clip, count, hist, tok_hist, any_out)
    _replay_nb(idx, vals, int(rows), int(C), float(clip), count, hist, tok_hist, any_out)


def pack_active(act: np.ndarray, tau: float) -> np.ndarray:
    """act float32[N, F] -> uint64[N, ceil(F/64)]: bit j of row t set when |act[t, j]| > tau."""
    bits = np.packbits(np.abs(act) > tau, axis=1, bitorder="little")
    pad = (-bits.shape[1]) % 8
    if pad:
        bits = np.pad(bits, ((0, 0), (0, pad)))
    return np.ascontiguousarray(bits).view(np.uint64)


def window_counts(on: np.ndarray, carry: np.ndarray, new: np.ndarray, resident: np.ndarray) -> np.ndarray:
    """Sliding-window counts for windows k = 1..K over one sequence's tokens, bit-parallel.

    on: uint64[N, W] packed activity (pack_active); carry: uint64[K, W], the packed activity of the
    K tokens before these (zeros at the start of a sequence). Adds to new int64[K] the firings not
    active in the k tokens before (loads from flash), and to resident int64[K] the neurons active in
    the k tokens ending at each token (held in DRAM). Returns the carry for the next call.
    Same numbers as window_update_ref's gap/age histograms (tested), 64 neurons per operation.
    """
    K = carry.shape[0]
    full = np.concatenate([carry, on])  # row K + t is token t
    N = on.shape[0]
    prev = np.zeros_like(on)  # OR over the k tokens before each token
    for k in range(1, K + 1):
        resident[k - 1] += int(np.bitwise_count(on | prev).sum())  # window t-k+1..t
        prev |= full[K - k:K - k + N]
        new[k - 1] += int(np.bitwise_count(on & ~prev).sum())
    return full[-K:].copy()


def log2_histogram(x: np.ndarray, out: np.ndarray) -> None:
    """Add |x| to a log-linear histogram: bin = float32 bits of |x| >> 18 (exponent + 5 mantissa bits).

    out: int64[8192]. 32 bins per octave (≤2.2% wide), exact to merge; see `log2_bin_edges`.
    Integer work only, so a pass over an activation costs about as much as np.abs.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rows = bits.shape[0] if bits.ndim == 2 else 0
    if not _blocked(rows):
        out += np.bincount(((bits & np.uint32(0x7FFFFFFF)) >> np.uint32(18)).ravel(), minlength=8192)[:8192]
        return
    # rows in fixed blocks over a host pass's threads, each counting into its own bins: integer sums, the same counts
    # (numba's count: ~5x numpy's three passes on one thread)
    edges = [round(rows * i / 8) for i in range(9)]
    parts = np.zeros((8, 8192), np.int64)

    def block(i, j):
        for p in range(i, j):
            _log2_hist_nb(bits[edges[p]:edges[p + 1]].ravel(), parts[p])
    run_blocks(block, [(p, p + 1) for p in range(8)])
    out += parts.sum(axis=0)


def log2_bin_edges() -> np.ndarray:
    """float64[8193]: lower edge of each log2_histogram bin (and the upper edge of the last)."""
    with np.errstate(invalid="ignore"):  # the top bins are inf/NaN bit patterns
        lower = (np.arange(8192, dtype=np.uint32) << np.uint32(18)).view(np.float32).astype(np.float64)
    lower[~np.isfinite(lower)] = np.inf  # bins of inf/NaN bit patterns
    return np.append(lower, np.inf)
