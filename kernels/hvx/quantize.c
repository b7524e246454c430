/* Per-tensor activation quantization on HVX, bit-exact with numpy's clip(rint(x / s), -127, 127) (round half to
 * even), for the W8A8 linear (mllm-NPU §3.3, eq. 1, int8 part).
 *
 * v67 HVX has no vector float, so the division is moved out of the loop: q(x) = rint(fl(x / s)) is a monotone
 * step function of |x|, so it is fixed by the 127 smallest magnitudes where it reaches 1, 2, ..., 127. Those
 * thresholds are found once per scale on the scalar core (exact division, hvx_float.c) and kept; each element
 * is then a 7-step binary search over them: an integer compare of float bit patterns (non-negative floats
 * order as their bits) and a vgather of the next thresholds, 32 lanes at a time.
 */
#include <hexagon_types.h>
#include <hvx_hexagon_protos.h>

#include "hvx_float.h"
#include "hvx_kernels.h"
#include "hvx_runtime.h"

#define F32_INF 0x7F800000u
#define NONE 0xFFFFFFFFu /* a level |x| never reaches (a NaN is sent to 0 on its own) */
#define CACHE 256        /* scales kept: a model's linears share few activation scales */

static uint32_t cached_scale[CACHE], cached_n;
static uint32_t thresholds[CACHE][128] __attribute__((aligned(128)));
static HVX_Vector gathered; /* vgather's destination (VTCM on a DSP) */

static inline uint32_t level(uint32_t x, const struct f32_divisor *ds) {
    return (uint32_t)f32_rint_clamp(f32_div(x, ds), 127);
}

/* the smallest float bit pattern g >= lo with level(g) >= n (levels are monotone), searched from a guess by
   doubling steps, then bisection */
static uint32_t first_at_least(uint32_t n, uint32_t lo, uint32_t guess, const struct f32_divisor *ds) {
    if (level(F32_INF, ds) < n) return NONE;
    if (guess < lo) guess = lo;
    if (guess > F32_INF) guess = F32_INF;
    int64_t a, b; /* level(a) < n (a may be lo - 1), level(b) >= n */
    if (level(guess, ds) >= n) {
        b = guess;
        for (int64_t step = 1;; step *= 2) {
            a = b - step < (int64_t)lo ? (int64_t)lo - 1 : b - step;
            if (a < (int64_t)lo || level((uint32_t)a, ds) < n) break;
            b = a;
        }
    } else {
        a = guess;
        for (int64_t step = 1;; step *= 2) {
            b = a + step > F32_INF ? F32_INF : a + step;
            if (level((uint32_t)b, ds) >= n) break;
            a = b;
        }
    }
    while (b - a > 1) {
        int64_t mid = a + (b - a) / 2;
        if (level((uint32_t)mid, ds) >= n) b = mid;
        else a = mid;
    }
    return (uint32_t)b;
}

const uint32_t *hvx_thresholds(uint32_t scale) {
    for (uint32_t i = 0; i < cached_n && i < CACHE; i++)
        if (cached_scale[i] == scale) return thresholds[i];
    uint32_t t0 = hvx_packets_now();
    uint32_t slot = cached_n++ % CACHE, *t = thresholds[slot];
    struct f32_divisor ds;
    f32_divisor_init(&ds, scale);
    float s = f32_from_bits(scale & 0x7FFFFFFF);
    t[0] = 0;
    for (uint32_t n = 1; n < 128; n++) {
        uint32_t guess = f32_bits(((float)n - 0.5f) * s); /* the boundary sits within a few ulps of here */
        t[n] = t[n - 1] == NONE ? NONE : first_at_least(n, t[n - 1], guess, &ds);
    }
    cached_scale[slot] = scale;
    hvx_scalar_packets += hvx_packets_now() - t0;
    return t;
}

/* 32 lanes of float bits -> their int32 levels, signed */
static inline HVX_Vector quantize_32(HVX_Vector xv, const uint32_t *t) {
    HVX_Vector zero = Q6_V_vzero(), ax = Q6_V_vand_VV(xv, Q6_V_vsplat_R(0x7FFFFFFF)), idx = zero;
    for (int32_t step = 64; step; step >>= 1) {
        HVX_Vector cand = Q6_Vw_vadd_VwVw(idx, Q6_V_vsplat_R(step));
        Q6_vgather_ARMVw(&gathered, (int)(uintptr_t)t, 128 * 4 - 1, Q6_Vw_vasl_VwR(cand, 2));
        idx = Q6_V_vmux_QVV(Q6_Q_vcmp_gt_VuwVuw(gathered, ax), idx, cand); /* |x| >= t[cand]: go up */
    }
    idx = Q6_V_vmux_QVV(Q6_Q_vcmp_gt_VuwVuw(ax, Q6_V_vsplat_R(F32_INF)), zero, idx); /* NaN -> 0 */
    return Q6_V_vmux_QVV(Q6_Q_vcmp_gt_VwVw(zero, xv), Q6_Vw_vsub_VwVw(zero, idx), idx);
}

static HVX_Vector tail;

void hvx_quantize_flat(const uint32_t *x, int8_t *q, uint32_t count, uint32_t scale) {
    const uint32_t *t = hvx_thresholds(scale);
    for (uint32_t i = 0; i < count; i += 128) {
        HVX_Vector w0 = quantize_32(*(const HVX_UVector *)(x + i), t);
        HVX_Vector w1 = quantize_32(*(const HVX_UVector *)(x + i + 32), t);
        HVX_Vector w2 = quantize_32(*(const HVX_UVector *)(x + i + 64), t);
        HVX_Vector w3 = quantize_32(*(const HVX_UVector *)(x + i + 96), t);
        HVX_Vector b = Q6_Vb_vpacke_VhVh(Q6_Vh_vpacke_VwVw(w3, w2), Q6_Vh_vpacke_VwVw(w1, w0)); /* 128 int8, in order */
        if (count - i >= 128) {
            *(HVX_UVector *)(q + i) = b;
        } else { /* the last partial vector: only the bytes that belong to the output */
            tail = b;
            for (uint32_t j = 0; j < count - i; j++) q[i + j] = ((const int8_t *)&tail)[j];
        }
    }
}

void hvx_quantize(const uint32_t *x, const uint32_t *smooth, uint32_t *xs, uint32_t sa, int8_t *q, uint32_t M,
                  uint32_t K, uint32_t Kp) {
    static struct f32_divisor smooth_div[HVX_MAX_K];
    if (smooth) { /* SmoothQuant's x / s per channel, exact, on the scalar core */
        uint32_t t0 = hvx_packets_now();
        for (uint32_t k = 0; k < K; k++) f32_divisor_init(&smooth_div[k], smooth[k]);
        for (uint32_t m = 0; m < M; m++)
            for (uint32_t k = 0; k < K; k++) xs[m * K + k] = f32_div(x[m * K + k], &smooth_div[k]);
        x = xs;
        hvx_scalar_packets += hvx_packets_now() - t0;
    }
    hvx_quantize_flat(x, q, M * K, sa);
    if (Kp != K) /* rows to a stride of Kp, zero-padded, last row first so nothing is overwritten before it moves */
        for (uint32_t m = M; m-- > 0;) {
            for (uint32_t k = Kp; k-- > K;) q[m * Kp + k] = 0;
            for (uint32_t k = K; k-- > 0;) q[m * Kp + k] = q[m * K + k];
        }
}
