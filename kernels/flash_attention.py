"""FP16 FlashAttention with FP32 row sums (NPU test-time scaling, Algorithm 1), numba beside numpy.

Q, K, V are FP16 (HMX operands). For each block of queries, key blocks are visited in order:
  S = fp16(Q K^T * scale)            (products accumulated in FP32, rounded to FP16 like HMX output)
  m' = max(m, rowmax S)              (FP16 values)
  P = exp_lut(S - m'), c = exp_lut(m - m')   (the 32768-entry FP16 exp table; arguments <= 0)
  l = l * c + rowsum(P)              (FP32: the paper keeps row sums in FP32)
  O = fp16(O * c + P V)              (FP16 accumulator, as on the NPU)
and finally out = O / l. Integer-free, so the kernel and the reference agree to FP16 rounding of the
summation order, not bit for bit; both are tested against float64 attention.
"""
from __future__ import annotations

import numpy as np

from .lut import _f16_values, exp_table

try:
    import numba

    from .lut import _f32_to_f16_bits
except ImportError:
    numba = None

BLOCK = 32


def _r16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def flash_attention_f16_ref(q, k, v, causal: bool = True, start: int = 0, block: int = BLOCK) -> np.ndarray:
    """q: [H, T, d], k, v: [H, S, d] (any float; rounded to FP16) -> float32[H, T, d].

    Query t sits at position start + t; with `causal`, it sees keys 0..start+t. H equals the KV heads'
    count (repeat K/V for grouped-query attention before calling).
    """
    table = exp_table()

    def exp_lut(x):  # x <= 0, float32 -> FP16 table value as float32
        return table[x.astype(np.float16).view(np.uint16) & np.uint16(0x7FFF)].astype(np.float32)

    q16, k16, v16 = _r16(q), _r16(k), _r16(v)
    H, T, d = q16.shape
    S = k16.shape[1]
    scale = np.float32(1.0 / np.sqrt(d))
    out = np.empty((H, T, d), np.float32)
    for i0 in range(0, T, block):
        i1 = min(i0 + block, T)
        m = np.full((H, i1 - i0), -np.inf, np.float32)
        l = np.zeros((H, i1 - i0), np.float32)
        o = np.zeros((H, i1 - i0, d), np.float32)
        last = min(S, start + i1) if causal else S
        for j0 in range(0, last, block):
            j1 = min(j0 + block, last)
            s = _r16(np.matmul(q16[:, i0:i1], k16[:, j0:j1].transpose(0, 2, 1)) * scale)
            if causal:
                s[:, np.arange(j0, j1)[None, :] > (start + np.arange(i0, i1))[:, None]] = -np.inf
            m_new = np.maximum(m, s.max(axis=-1))
            p = exp_lut(_r16(s - m_new[..., None]))
            c = np.where(np.isneginf(m), 0.0, exp_lut(_r16(m - m_new))).astype(np.float32)
            l = l * c + p.sum(axis=-1, dtype=np.float32)
            o = _r16(o * c[..., None] + np.matmul(p, v16[:, j0:j1]))
            m = m_new
        out[:, i0:i1] = o / l[..., None]
    return out


if numba is not None:
    @numba.njit(parallel=True, nogil=True, cache=True)
    def _flash_nb(q, k, v, causal, start, block, f16_of, table, out):
        H, T, d = q.shape
        S = k.shape[1]
        scale = np.float32(1.0 / np.sqrt(d))
        nqb = (T + block - 1) // block
        for job in numba.prange(H * nqb):
            h = job // nqb
            i0 = (job % nqb) * block
            i1 = min(i0 + block, T)
            n = i1 - i0
            m = np.full(n, -np.inf, np.float32)
            l = np.zeros(n, np.float32)
            o = np.zeros((n, d), np.float32)
            s = np.empty(block, np.float32)
            last = min(S, start + i1) if causal else S
            for j0 in range(0, last, block):
                j1 = min(j0 + block, last)
                for ii in range(n):
                    i = i0 + ii
                    rowmax = np.float32(-np.inf)
                    for jj in range(j1 - j0):
                        j = j0 + jj
                        if causal and j > start + i:
                            s[jj] = -np.inf
                            continue
                        acc = np.float32(0.0)
                        for t in range(d):
                            acc += q[h, i, t] * k[h, j, t]
                        s[jj] = f16_of[_f32_to_f16_bits(acc * scale)]
                        rowmax = max(rowmax, s[jj])
                    m_new = max(m[ii], rowmax)
                    c = np.float32(0.0)
                    if m[ii] > -np.inf:
                        c = f16_of[table[_f32_to_f16_bits(f16_of[_f32_to_f16_bits(m[ii] - m_new)]) & 0x7FFF]]
                    psum = np.float32(0.0)
                    for t in range(d):
                        o[ii, t] *= c
                    for jj in range(j1 - j0):
                        if s[jj] == -np.inf:
                            continue
                        p = f16_of[table[_f32_to_f16_bits(f16_of[_f32_to_f16_bits(s[jj] - m_new)]) & 0x7FFF]]
                        psum += p
                        for t in range(d):
                            o[ii, t] += p * v[h, j0 + jj, t]
                    for t in range(d):
                        o[ii, t] = f16_of[_f32_to_f16_bits(o[ii, t])]
                    l[ii] = l[ii] * c + psum
                    m[ii] = m_new
            for ii in range(n):
                for t in range(d):
                    out[h, i0 + ii, t] = o[ii, t] / l[ii]


def flash_attention_f16(q, k, v, causal: bool = True, start: int = 0, block: int = BLOCK) -> np.ndarray:
    """See flash_attention_f16_ref; numba kernel when available."""
    if numba is None:
        return flash_attention_f16_ref(q, k, v, causal, start, block)
    q16, k16, v16 = (np.ascontiguousarray(_r16(x)) for x in (q, k, v))
    out = np.empty(q16.shape, np.float32)
    _flash_nb(q16, k16, v16, causal, int(start), int(block), _f16_values(), exp_table().view(np.uint16), out)
    return out
