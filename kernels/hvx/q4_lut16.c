/* Q4_0 tile super-blocks -> float16 through vlut16 (NPU TTS paper §5.1; kernels/tiles.py byte layout).
 *
 * vlut16 (128-byte mode) looks up each index byte in a table of 16-bit entries spread over a whole vector:
 * entry j of the table that match value v selects lives in halfword 2 * (((v & 1) << 4) | j) + ((v >> 1) & 1),
 * and an index byte takes part only when its high nibble equals v. So one table vector holds four 16-entry
 * tables (four Q4 groups), and four lookups OR-ed together dequantize 128 nibbles, each against its own group's
 * table. Its output pair is split by byte parity (even index bytes in the low vector, odd in the high): vshuff
 * puts them back in order. Reading it as a plain table[index] gets every other entry.
 */
#include <hexagon_types.h>
#include <hvx_hexagon_protos.h>

#include "hvx_kernels.h"

#define SB_BYTES 144

static uint16_t k_abs[64] __attribute__((aligned(128)));  /* |j - 8| of the entry in each table halfword */
static uint16_t k_sign[64] __attribute__((aligned(128))); /* 0x8000 where j - 8 < 0 */
static uint8_t group_nibble[128] __attribute__((aligned(128))); /* byte b: (group of b within its half) << 4 */

static void init_constants(void) {
    for (uint32_t h = 0; h < 64; h++) {
        int32_t k = (int32_t)((h >> 1) & 15) - 8;
        k_abs[h] = (uint16_t)(k < 0 ? -k : k);
        k_sign[h] = k < 0 ? 0x8000 : 0;
    }
    for (uint32_t b = 0; b < 128; b++) group_nibble[b] = (uint8_t)((b >> 5) << 4);
}

#define H(v) Q6_Vh_vsplat_R(v)

/* float16 d times a small integer (|k| <= 8) per halfword lane, rounded to nearest even, in integers: the
   product of the significands has at most 14 bits; keep 11, round the rest away, add the shift to the exponent.
   A subnormal d is the same with exponent 1 and no hidden bit; the encoding ((E - 1) << 10) + significand then
   comes out right for normal, subnormal, a rounding carry, and overflow clamped to inf. d must be finite. */
static HVX_Vector f16_times_small(HVX_Vector d, HVX_Vector kabs, HVX_Vector ksign) {
    HVX_Vector zero = Q6_V_vzero(), one = H(1);
    HVX_Vector sign = Q6_V_vand_VV(Q6_V_vxor_VV(d, ksign), H(0x8000));
    HVX_Vector e = Q6_V_vand_VV(Q6_Vuh_vlsr_VuhR(d, 10), H(0x1F)), f = Q6_V_vand_VV(d, H(0x3FF));
    HVX_Vector m = Q6_V_vmux_QVV(Q6_Q_vcmp_gt_VhVh(e, zero), Q6_V_vor_VV(f, H(0x400)), f);
    HVX_Vector E = Q6_Vh_vmax_VhVh(e, one);
    HVX_Vector P = Q6_Vh_vmpyi_VhVh(kabs, m);                                             /* < 2^14 */
    HVX_Vector sh = Q6_Vh_vmax_VhVh(Q6_Vh_vsub_VhVh(H(5), Q6_Vuh_vcl0_Vuh(P)), zero);   /* bits beyond 11 */
    HVX_Vector mant = Q6_Vh_vlsr_VhVh(P, sh);
    HVX_Vector rem2 = Q6_Vh_vasl_VhR(Q6_Vh_vsub_VhVh(P, Q6_Vh_vasl_VhVh(mant, sh)), 1); /* 2 x dropped bits */
    HVX_Vector half2 = Q6_Vh_vasl_VhVh(one, sh);                                          /* 2 x half an ulp */
    HVX_VectorPred up = Q6_Q_or_QQ(Q6_Q_vcmp_gt_VhVh(rem2, half2),
                                   Q6_Q_and_QQ(Q6_Q_vcmp_eq_VhVh(rem2, half2),
                                               Q6_Q_vcmp_eq_VhVh(Q6_V_vand_VV(mant, one), one)));
    HVX_Vector bits = Q6_Vh_vadd_VhVh(Q6_Vh_vasl_VhR(Q6_Vh_vsub_VhVh(Q6_Vh_vadd_VhVh(E, sh), one), 10), mant);
    bits = Q6_Vh_vadd_VhVh(bits, Q6_V_vmux_QVV(up, one, zero));
    bits = Q6_Vuh_vmin_VuhVuh(bits, H(0x7C00));
    bits = Q6_V_vmux_QVV(Q6_Q_vcmp_eq_VhVh(P, zero), zero, bits); /* k = 0 or d = 0: a zero of the right sign */
    return Q6_V_vor_VV(bits, sign);
}

/* the table vector of groups g0..g0+3: (j - 8) * d_g in the halfword vlut16 reads for match value g - g0 */
static HVX_Vector table_of(const uint8_t *scales, uint32_t g0) {
    uint32_t d[4];
    for (uint32_t i = 0; i < 4; i++) d[i] = scales[2 * (g0 + i)] | (uint32_t)scales[2 * (g0 + i) + 1] << 8;
    HVX_Vector dv = Q6_V_vmux_QVV(Q6_Q_vsetq_R(64), Q6_V_vsplat_R(d[0] | d[2] << 16), Q6_V_vsplat_R(d[1] | d[3] << 16));
    return f16_times_small(dv, *(const HVX_Vector *)k_abs, *(const HVX_Vector *)k_sign);
}

static inline void lookup_128(HVX_Vector idx, HVX_Vector table, HVX_Vector *out) {
    HVX_VectorPair p = Q6_Wh_vlut16_VbVhR(idx, table, 0);
    p = Q6_Wh_vlut16or_WhVbVhR(p, idx, table, 1);
    p = Q6_Wh_vlut16or_WhVbVhR(p, idx, table, 2);
    p = Q6_Wh_vlut16or_WhVbVhR(p, idx, table, 3);
    HVX_VectorPair ordered = Q6_W_vshuff_VVR(Q6_V_hi_W(p), Q6_V_lo_W(p), -2); /* even/odd halves -> in order */
    out[0] = Q6_V_lo_W(ordered);
    out[1] = Q6_V_hi_W(ordered);
}

void hvx_q4_tile_dequant(const uint8_t *blocks, uint16_t *out, uint32_t S) {
    init_constants();
    HVX_Vector groups = *(const HVX_Vector *)group_nibble, low4 = Q6_Vb_vsplat_R(0x0F);
    HVX_Vector *o = (HVX_Vector *)out;
    for (uint32_t s = 0; s < S; s++, o += 4) {
        const uint8_t *blk = blocks + s * SB_BYTES;
        HVX_Vector codes = *(const HVX_UVector *)(blk + 16); /* super-blocks are 144 bytes: unaligned */
        HVX_Vector lo = Q6_V_vor_VV(Q6_V_vand_VV(codes, low4), groups);                      /* values 0..127 */
        HVX_Vector hi = Q6_V_vor_VV(Q6_V_vand_VV(Q6_Vuh_vlsr_VuhR(codes, 4), low4), groups); /* 128..255 */
        lookup_128(lo, table_of(blk, 0), o);
        lookup_128(hi, table_of(blk, 4), o + 2);
    }
}
