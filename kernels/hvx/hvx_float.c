/* IEEE float32 / float16 arithmetic in integers on the scalar core: see hvx_float.h. */
#include "hvx_float.h"

#define F32_QNAN_DEFAULT 0xFFC00000u /* x86's "real indefinite": what numpy on the host returns for 0/0 */

/* significand normalised to [2^23, 2^24) and the exponent that goes with it (subnormals included) */
static inline uint32_t f32_unpack(uint32_t bits, int32_t *exp) {
    uint32_t e = (bits >> 23) & 0xFF, sig = bits & 0x7FFFFF;
    if (e) {
        *exp = (int32_t)e;
        return sig | 0x800000;
    }
    int shift = __builtin_clz(sig) - 8;
    *exp = 1 - shift;
    return sig << shift;
}

void f32_divisor_init(struct f32_divisor *d, uint32_t bits) {
    uint32_t e = (bits >> 23) & 0xFF;
    d->bits = bits;
    d->sig = 0;
    d->exp = 0;
    d->inv = 0;
    if (e == 0xFF || (bits & 0x7FFFFFFF) == 0) return; /* inf, nan, zero: f32_div special-cases them */
    d->sig = f32_unpack(bits, &d->exp);
    uint64_t q = 0, r = 0; /* restoring division of 2^61 by sig, once per divisor */
    for (int i = 61; i >= 0; i--) {
        r = (r << 1) | (i == 61);
        q <<= 1;
        if (r >= d->sig) {
            r -= d->sig;
            q |= 1;
        }
    }
    d->inv = q;
}

uint32_t f32_div(uint32_t a, const struct f32_divisor *d) {
    uint32_t b = d->bits, sign = (a ^ b) & 0x80000000u;
    uint32_t a_abs = a & 0x7FFFFFFF, b_abs = b & 0x7FFFFFFF;
    if (a_abs > 0x7F800000u) return a | 0x400000u; /* NaN operands come back quieted, a first */
    if (b_abs > 0x7F800000u) return b | 0x400000u;
    if (a_abs == 0x7F800000u) return b_abs == 0x7F800000u ? F32_QNAN_DEFAULT : sign | 0x7F800000u;
    if (b_abs == 0x7F800000u) return sign;
    if (b_abs == 0) return a_abs == 0 ? F32_QNAN_DEFAULT : sign | 0x7F800000u;
    if (a_abs == 0) return sign;

    int32_t ea;
    uint64_t ma = f32_unpack(a, &ea), mb = d->sig;
    int32_t e = ea - d->exp + 127;
    if (ma < mb) { /* quotient of significands in [1, 2) */
        ma <<= 1;
        e -= 1;
    }
    /* q = floor(ma * 2^26 / mb), 27 bits: 24 for the result, 3 to round with; the reciprocal's estimate is at
       most one below */
    uint64_t num = ma << 26;
    uint64_t q = (ma * d->inv) >> 35;
    uint64_t r = num - q * mb;
    if (r >= mb) {
        q += 1;
        r -= mb;
    }
    uint32_t sticky = r != 0, Q = (uint32_t)q;
    if (e >= 0xFF) return sign | 0x7F800000u;
    if (e >= 1) {
        uint32_t mant = Q >> 3, rb = Q & 7;
        mant += rb > 4 || (rb == 4 && (sticky || (mant & 1)));
        if (mant == (1u << 24)) {
            mant >>= 1;
            e += 1;
            if (e >= 0xFF) return sign | 0x7F800000u;
        }
        return sign | ((uint32_t)e << 23) | (mant & 0x7FFFFF);
    }
    int32_t sh = 4 - e; /* subnormal result: units of 2^-149 */
    if (sh >= 28) return sign;
    uint32_t mant = Q >> sh, rem = Q & ((1u << sh) - 1), half = 1u << (sh - 1);
    mant += rem > half || (rem == half && (sticky || (mant & 1)));
    return sign | mant; /* a carry to 2^23 lands on the smallest normal, as it should */
}

int32_t f32_rint_clamp(uint32_t v, int32_t lim) {
    uint32_t e = (v >> 23) & 0xFF, frac = v & 0x7FFFFF;
    int neg = v >> 31;
    if (e == 0xFF && frac) return 0;
    int32_t n;
    if (e >= 150) {
        n = lim; /* |v| >= 2^23: an integer beyond any clamp used here (lim < 2^23) */
    } else if (e < 126 - 1) {
        n = 0; /* |v| < 0.25 (subnormals too) */
    } else {
        uint32_t m = frac | 0x800000, sh = 150 - e; /* |v| = m / 2^sh, 1 <= sh <= 25 */
        uint32_t q = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
        q += rem > half || (rem == half && (q & 1));
        n = q > (uint32_t)lim ? lim : (int32_t)q;
    }
    return neg ? -n : n;
}

uint32_t f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, f = h & 0x3FF;
    if (e == 0x1F) return s | 0x7F800000u | (f << 13);
    if (e == 0) {
        if (f == 0) return s;
        uint32_t e32 = 127 - 15 + 1;
        while (!(f & 0x400)) {
            f <<= 1;
            e32 -= 1;
        }
        return s | (e32 << 23) | ((f & 0x3FF) << 13);
    }
    return s | ((e + 112) << 23) | (f << 13);
}

uint16_t f32_to_f16(uint32_t f) {
    uint32_t s = (f >> 16) & 0x8000, e = (f >> 23) & 0xFF, m = f & 0x7FFFFF;
    if (e == 0xFF) return (uint16_t)(s | 0x7C00 | (m ? 0x200 | (m >> 13) : 0));
    int32_t ue = (int32_t)e - 127;
    if (ue > 15) return (uint16_t)(s | 0x7C00);
    if (ue >= -14) {
        uint32_t m10 = m >> 13, rem = m & 0x1FFF;
        uint32_t h = ((uint32_t)(ue + 15) << 10) + m10 + (rem > 0x1000 || (rem == 0x1000 && (m10 & 1)));
        return (uint16_t)(s | h); /* a carry out of the mantissa bumps the exponent, up to inf */
    }
    if (ue < -25) return (uint16_t)s;
    uint32_t mm = m | 0x800000, sh = (uint32_t)(-ue - 1); /* subnormal half: units of 2^-24, 14 <= sh <= 24 */
    uint32_t n = mm >> sh, rem = mm & ((1u << sh) - 1), half = 1u << (sh - 1);
    n += rem > half || (rem == half && (n & 1));
    return (uint16_t)(s | n);
}
