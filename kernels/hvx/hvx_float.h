/* IEEE-754 float32 / float16 on the scalar core, in integers, rounding as numpy does (to nearest, ties to
 * even), so the Hexagon results are bit-identical to the numpy references. v67 has no vector float and its
 * compiler runtime (a float division is a call to __hexagon_divsf3) is not linked in this freestanding build.
 */
#ifndef EDGEPROBE_HVX_FLOAT_H
#define EDGEPROBE_HVX_FLOAT_H

#include <stdint.h>

static inline uint32_t f32_bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
static inline float f32_from_bits(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }

/* A divisor prepared once (a per-tensor or per-channel scale): its significand and 2^61 / significand, so each
 * division is one 64-bit multiply and at most one correction instead of a bit-serial loop. */
struct f32_divisor {
    uint32_t bits;   /* the divisor's float32 bit pattern */
    uint32_t sig;    /* significand normalised to [2^23, 2^24) (0 for zero / inf / nan) */
    int32_t exp;     /* unbiased-style exponent matching sig */
    uint64_t inv;    /* floor(2^61 / sig) */
};

void f32_divisor_init(struct f32_divisor *d, uint32_t bits);
/* a / d rounded to nearest even, as a float32 bit pattern (x86 conventions for NaN results) */
uint32_t f32_div(uint32_t a, const struct f32_divisor *d);
/* rint(v) clamped to [-lim, lim] (numpy: clip(rint(v), -lim, lim)); NaN gives 0 */
int32_t f32_rint_clamp(uint32_t v, int32_t lim);
/* float16 bits -> float32 bits (exact), float32 bits -> float16 bits (nearest even, overflow to inf) */
uint32_t f16_to_f32(uint16_t h);
uint16_t f32_to_f16(uint32_t f);

#endif
