"""Table-lookup kernels of the Hexagon NPU (NPU test-time scaling §4-5): INT4 -> FP16 by a 16-entry
table per group (HVX vlut16 semantics), and exp by a 32768-entry FP16 table.

Q4_0 groups (ggml's rule): 32 values share an FP16 scale d = v / -8, v the value of largest |x|;
q = min(15, trunc(x / d + 8.5)) in 0..15; dequantized value (q - 8) * d. vlut16 semantics: the 16
FP16 values (i - 8) * d are built once per group and every nibble indexes them, so dequantization
is a lookup, not a multiply; results are bit-identical to (q - 8) * d rounded to FP16.
"""
from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:
    numba = None

GROUP = 32


def q4_quantize_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: float32[G, 32] -> (q uint8[G, 32] in 0..15, d float16[G]) by ggml's Q4_0 rule."""
    idx = np.abs(x).argmax(axis=1)
    vmax = x[np.arange(len(x)), idx]
    d = (vmax / -8.0).astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, (x * inv[:, None] + 8.5).astype(np.int32)).astype(np.uint8)  # trunc, as ggml
    return q, d.astype(np.float16)


def lut16_dequant_ref(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q: uint8[G, 32] nibble values, d: float16[G] -> float16[G, 32] via a 16-entry table per group."""
    table = ((np.arange(16, dtype=np.float32) - 8)[None, :] * d.astype(np.float32)[:, None]).astype(np.float16)
    return np.take_along_axis(table, q.astype(np.int64), axis=1)


if numba is not None:
    @numba.njit(nogil=True, cache=True)
    def _lut16_dequant_nb(q, d16bits, f16_of, out_bits):
        # d16bits: uint16[G] FP16 bit patterns; f16_of: float32[65536] value of every FP16 pattern;
        # tables are built in float32 then rounded to FP16 through the precomputed rounding below.
        G = q.shape[0]
        lut = np.empty(16, np.uint16)
        for g in range(G):
            d = f16_of[d16bits[g]]
            for i in range(16):
                lut[i] = _f32_to_f16_bits(np.float32((i - 8) * d))
            for e in range(q.shape[1]):
                out_bits[g, e] = lut[q[g, e]]

    from llvmlite import ir as _ir
    from numba import extending as _extending
    from numba.core import types as _types

    @_extending.intrinsic
    def _f32_bits(typingctx, v):
        """float32 -> its uint32 bit pattern, one LLVM bitcast (an np.array(...).view per call cost ~20 ns)."""
        if v != _types.float32:
            return None
        return _types.uint32(_types.float32), lambda ctx, builder, sig, args: builder.bitcast(args[0], _ir.IntType(32))

    @_extending.intrinsic
    def _bits_f32(typingctx, b):
        """uint32 bit pattern -> float32, one LLVM bitcast."""
        if b != _types.uint32:
            return None
        return _types.float32(_types.uint32), lambda ctx, builder, sig, args: builder.bitcast(args[0], _ir.FloatType())

    @numba.njit(inline="always")
    def _group_lut(d, f16_of, lut):
        # lut[i] = (i - 8) * d rounded to FP16, as float32; where every product is a normal FP16 (|d| in
        # [2^-14, 4096]) the rounding is one add and mask on the float32 bits (round to nearest even at bit 13)
        a = abs(d)
        if a >= np.float32(6.103515625e-05) and a <= np.float32(4096.0):
            for i in range(16):
                b = _f32_bits(np.float32((i - 8) * d))
                b = (b + np.uint32(0x0FFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
                lut[i] = _bits_f32(np.uint32(b))
        else:
            for i in range(16):
                lut[i] = f16_of[_f32_to_f16_bits(np.float32((i - 8) * d))]

    @numba.njit(inline="always")
    def _f32_to_f16_bits(v):
        # round-to-nearest-even float32 -> float16 bit pattern (normal, subnormal, overflow to inf)
        b = _f32_bits(np.float32(v))
        sign = (b >> 16) & 0x8000
        exp = np.int32((b >> 23) & 0xFF) - 127 + 15
        mant = b & 0x7FFFFF
        if exp >= 31:
            return np.uint16(sign | 0x7C00)
        if exp <= 0:
            if exp < -10:
                return np.uint16(sign)
            mant = mant | 0x800000
            shift = 14 - exp
            half = np.uint32(1) << (shift - 1)
            rest = mant & ((np.uint32(1) << shift) - 1)
            m = mant >> shift
            if rest > half or (rest == half and (m & 1)):
                m += 1
            return np.uint16(sign | m)
        m = mant >> 13
        rest = mant & 0x1FFF
        if rest > 0x1000 or (rest == 0x1000 and (m & 1)):
            m += 1
            if m == 0x400:
                m = 0
                exp += 1
                if exp >= 31:
                    return np.uint16(sign | 0x7C00)
        return np.uint16(sign | (exp << 10) | m)


_F16_VALUES = None


def _f16_values() -> np.ndarray:
    global _F16_VALUES
    if _F16_VALUES is None:
        _F16_VALUES = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    return _F16_VALUES


def lut16_dequant(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """See lut16_dequant_ref: float16[G, 32] (numba kernel when available; bit-identical)."""
    if numba is None:
        return lut16_dequant_ref(q, d)
    out = np.empty(q.shape, np.uint16)
    _lut16_dequant_nb(np.ascontiguousarray(q), np.ascontiguousarray(d.astype(np.float16)).view(np.uint16),
                      _f16_values(), out)
    return out.view(np.float16)


# ---- exp through a 32768-entry FP16 table ---------------------------------------------------------

def exp_table() -> np.ndarray:
    """float16[32768]: entry i = exp(-v) for v the non-negative FP16 with bit pattern i.

    Safe softmax feeds x - max(x) <= 0; dropping the sign bit of that FP16 value indexes this table.
    """
    v = np.arange(32768, dtype=np.uint16).view(np.float16).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.exp(-v)
    t[np.isnan(t)] = 0.0  # NaN patterns: treat as -inf input
    return t.astype(np.float16)


_EXP = None


def exp_lut(x: np.ndarray) -> np.ndarray:
    """exp of non-positive inputs by table lookup: x float16/float32 <= 0 -> float16."""
    global _EXP
    if _EXP is None:
        _EXP = exp_table()
    bits = np.asarray(x, dtype=np.float16).view(np.uint16) & np.uint16(0x7FFF)
    return _EXP[bits]


def exp_lut_max_error() -> dict:
    """Max absolute and relative error of exp_lut against float64 exp over every non-positive FP16."""
    v = -np.arange(32768, dtype=np.uint16).view(np.float16)
    v = v[np.isfinite(v)]
    ref = np.exp(v.astype(np.float64))
    got = exp_lut(v).astype(np.float64)
    rel = np.abs(got - ref) / np.maximum(ref, np.finfo(np.float64).tiny)
    normal = ref >= 2.0 ** -14  # FP16 normal range: relative error bounded by half an ulp
    return {"max_abs_error": float(np.abs(got - ref).max()), "max_rel_error_normal": float(rel[normal].max()),
            "entries": 32768}
