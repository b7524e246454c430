"""Streaming per-channel activation statistics: numba kernels, each beside its numpy reference.

Used by edgeprobe's profilers (mllm-NPU §3.3 outliers; LLM in a flash §3 sliding window). The
kernels make one pass over an activation, release the GIL and allocate nothing, so profiling adds
a few percent to the forward pass; the references define what they compute and test them.
"""
from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:  # a phone without numba falls back to the references
    numba = None

# Bins of |x| / clip: [<1/4) (implicit), [1/4,1/2), [1/2,1), [1,2), [2,4), ..., [2^(N_RATIO_BINS-3), inf)
N_RATIO_BINS = 11
RATIO_EDGES = 2.0 ** np.arange(-2, N_RATIO_BINS - 2)  # lower edges of bins 0..N-1


def outlier_update_ref(x, clip, fixed, chmax, count, count_fixed, hist, tok_hist, any_out):
    """Accumulate one activation into per-channel outlier statistics (all arrays updated in place).

    x: float32[N, C]; clip: float, the per-tensor clip value (int8 scale * 127): |x| > clip is an
    outlier (mllm-NPU eq. 1); fixed: float, LLM.int8()'s absolute threshold (6.0).
    chmax float32[C] running max |x|; count / count_fixed int64[C] values beyond clip / fixed;
    hist int64[C, N_RATIO_BINS] counts of |x|/clip per RATIO_EDGES bin (values < 1/4 not counted);
    tok_hist int64[C+1] tokens by their number of outlier channels; any_out bool[C] (|=).
    """
    a = np.abs(x)
    np.maximum(chmax, a.max(axis=0), out=chmax)
    out = a > clip
    count += out.sum(axis=0)
    count_fixed += (a > fixed).sum(axis=0)
    r = a / clip
    b = np.clip(np.floor(np.log2(np.maximum(r, 1e-30))).astype(np.int64) + 2, 0, N_RATIO_BINS - 1)
    C = x.shape[1]
    keep = r >= 0.25
    np.add.at(hist, (np.nonzero(keep)[1], b[keep]), 1)
    tok_hist += np.bincount(out.sum(axis=1), minlength=C + 1)
    any_out |= out.any(axis=0)


NEVER = -(1 << 62)  # `last` value of a neuron that has not fired in this sequence


def window_update_ref(active, last, t0, K, fire, gap_hist, age_hist):
    """Sliding-window neuron residency over one sequence's tokens, in order (LLM in a flash §3.2).

    active: bool[N, F], token t0+t fired neuron j; last: int64[F] sequence position at which each
    neuron last fired (NEVER at the start of a sequence), updated; K: the largest window.
    fire int64[F] += firings. gap_hist int64[K+2]: for each firing, position - last[j] capped at
    K+1: a firing is a new load for window k iff its gap > k. age_hist int64[K+2]: for each token and
    neuron, position - last[j] after the update, capped at K+1: resident in window k iff age < k.
    """
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
    def _outlier_update_nb(x, clip, fixed, chmax, count, count_fixed, hist, tok_hist, any_out):
        N, C = x.shape
        inv = 1.0 / clip
        for n in range(N):
            k = 0
            for c in range(C):
                a = abs(x[n, c])
                if a > chmax[c]:
                    chmax[c] = a
                if a > fixed:
                    count_fixed[c] += 1
                r = a * inv
                if r >= 0.25:
                    b = int(np.floor(np.log2(r))) + 2
                    hist[c, min(max(b, 0), N_RATIO_BINS - 1)] += 1
                    if a > clip:
                        count[c] += 1
                        any_out[c] = True
                        k += 1
            tok_hist[k] += 1

    @numba.njit(nogil=True, cache=True)
    def _window_update_nb(active, last, t0, K, fire, gap_hist, age_hist):
        N, F = active.shape
        for t in range(N):
            pos = t0 + t
            for j in range(F):
                if active[t, j]:
                    fire[j] += 1
                    gap_hist[min(max(pos - last[j], 0), K + 1)] += 1
                    last[j] = pos
                age_hist[min(max(pos - last[j], 0), K + 1)] += 1


def outlier_update(x, clip, fixed, chmax, count, count_fixed, hist, tok_hist, any_out):
    """See outlier_update_ref; numba when available and x is C-contiguous float32."""
    C = x.shape[1]
    if hist.shape != (C, N_RATIO_BINS) or tok_hist.shape != (C + 1,) or chmax.shape != (C,):
        raise ValueError(f"outlier_update: state arrays do not match {C} channels")
    if numba is None or x.dtype != np.float32 or not x.flags.c_contiguous:
        return outlier_update_ref(x, clip, fixed, chmax, count, count_fixed, hist, tok_hist, any_out)
    _outlier_update_nb(x, float(clip), float(fixed), chmax, count, count_fixed, hist, tok_hist, any_out)


def window_update(active, last, t0, K, fire, gap_hist, age_hist):
    """See window_update_ref; numba when available."""
    if gap_hist.shape != (K + 2,) or age_hist.shape != (K + 2,) or last.shape != (active.shape[1],):
        raise ValueError("window_update: gap_hist/age_hist need K+2 entries and last one per neuron")
    if numba is None:
        return window_update_ref(active, last, t0, K, fire, gap_hist, age_hist)
    _window_update_nb(np.ascontiguousarray(active), last, int(t0), int(K), fire, gap_hist, age_hist)


def log2_histogram(x: np.ndarray, out: np.ndarray) -> None:
    """Add |x| to a log-linear histogram: bin = float32 bits of |x| >> 18 (exponent + 5 mantissa bits).

    out: int64[8192]. 32 bins per octave (≤2.2% wide), exact to merge; see `log2_bin_edges`.
    Integer work only, so a pass over an activation costs about as much as np.abs.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    out += np.bincount((bits >> np.uint32(18)).ravel(), minlength=8192)[:8192]


def log2_bin_edges() -> np.ndarray:
    """float64[8193]: lower edge of each log2_histogram bin (and the upper edge of the last)."""
    with np.errstate(invalid="ignore"):  # the top bins are inf/NaN bit patterns
        lower = (np.arange(8192, dtype=np.uint32) << np.uint32(18)).view(np.float32).astype(np.float64)
    lower[~np.isfinite(lower)] = np.inf  # bins of inf/NaN bit patterns
    return np.append(lower, np.inf)
