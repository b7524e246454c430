/* int8 x int8 -> int32 GEMM with vrmpy, per-tensor quantization and requantization: the W8A8 linear of the
 * npu lane (mllm-NPU §3.3, eq. 1, int8 part). Reference: edgeprobe_kernels.int8_gemm / linear_records.run_w8a8.
 */
#include <hexagon_types.h>
#include <hvx_hexagon_protos.h>

#include "hvx_float.h"
#include "hvx_kernels.h"
#include "hvx_runtime.h"

#define SPLAT4(p, g) Q6_V_vsplat_R(((const int32_t *)(p))[g]) /* 4 int8 inputs in every 32-bit lane */
#define MAC(acc, w, x) acc = Q6_Vw_vrmpyacc_VwVbVb(acc, w, x)

/* 4 rows of a (pointers may repeat for a tail) against every column: 4 vectors (128 columns) at a time, so
   16 accumulators + 4 weight vectors + 4 splats stay in the 32 vector registers. */
static void gemm_4rows(const int8_t *a0, const int8_t *a1, const int8_t *a2, const int8_t *a3,
                       const HVX_Vector *b, uint32_t nv, uint32_t k4,
                       HVX_Vector *c0, HVX_Vector *c1, HVX_Vector *c2, HVX_Vector *c3) {
    uint32_t j = 0;
    for (; j + 4 <= nv; j += 4) {
        HVX_Vector s00 = Q6_V_vzero(), s01 = s00, s02 = s00, s03 = s00, s10 = s00, s11 = s00, s12 = s00, s13 = s00;
        HVX_Vector s20 = s00, s21 = s00, s22 = s00, s23 = s00, s30 = s00, s31 = s00, s32 = s00, s33 = s00;
        const HVX_Vector *bk = b + j;
        for (uint32_t g = 0; g < k4; g++, bk += nv) {
            HVX_Vector w0 = bk[0], w1 = bk[1], w2 = bk[2], w3 = bk[3];
            HVX_Vector x0 = SPLAT4(a0, g), x1 = SPLAT4(a1, g), x2 = SPLAT4(a2, g), x3 = SPLAT4(a3, g);
            MAC(s00, w0, x0); MAC(s01, w1, x0); MAC(s02, w2, x0); MAC(s03, w3, x0);
            MAC(s10, w0, x1); MAC(s11, w1, x1); MAC(s12, w2, x1); MAC(s13, w3, x1);
            MAC(s20, w0, x2); MAC(s21, w1, x2); MAC(s22, w2, x2); MAC(s23, w3, x2);
            MAC(s30, w0, x3); MAC(s31, w1, x3); MAC(s32, w2, x3); MAC(s33, w3, x3);
        }
        c0[j] = s00; c0[j + 1] = s01; c0[j + 2] = s02; c0[j + 3] = s03;
        c1[j] = s10; c1[j + 1] = s11; c1[j + 2] = s12; c1[j + 3] = s13;
        c2[j] = s20; c2[j + 1] = s21; c2[j + 2] = s22; c2[j + 3] = s23;
        c3[j] = s30; c3[j + 1] = s31; c3[j + 2] = s32; c3[j + 3] = s33;
    }
    for (; j < nv; j++) { /* the last 1-3 vectors of columns */
        HVX_Vector s0 = Q6_V_vzero(), s1 = s0, s2 = s0, s3 = s0;
        const HVX_Vector *bk = b + j;
        for (uint32_t g = 0; g < k4; g++, bk += nv) {
            HVX_Vector w = bk[0];
            MAC(s0, w, SPLAT4(a0, g)); MAC(s1, w, SPLAT4(a1, g)); MAC(s2, w, SPLAT4(a2, g)); MAC(s3, w, SPLAT4(a3, g));
        }
        c0[j] = s0; c1[j] = s1; c2[j] = s2; c3[j] = s3;
    }
}

/* rows m0..m0+3 of a, clamped to the last row (a tail recomputes that row: same values, written twice) */
#define ROW(base, stride, m, M) ((base) + (uint32_t)((m) < (M) ? (m) : (M) - 1) * (stride))

void hvx_gemm_s8s32(const int8_t *a, const uint8_t *bp, int32_t *c, uint32_t M, uint32_t Kp, uint32_t Np) {
    uint32_t nv = Np / 32;
    for (uint32_t m = 0; m < M; m += 4)
        gemm_4rows(ROW(a, Kp, m, M), ROW(a, Kp, m + 1, M), ROW(a, Kp, m + 2, M), ROW(a, Kp, m + 3, M),
                   (const HVX_Vector *)bp, nv, Kp / 4,
                   (HVX_Vector *)ROW(c, Np, m, M), (HVX_Vector *)ROW(c, Np, m + 1, M),
                   (HVX_Vector *)ROW(c, Np, m + 2, M), (HVX_Vector *)ROW(c, Np, m + 3, M));
}

void hvx_requantize(const int32_t *c, uint32_t scale, uint32_t *y, uint32_t M, uint32_t N, uint32_t Np) {
    float s = f32_from_bits(scale);
    for (uint32_t m = 0; m < M; m++) {
        const int32_t *cr = c + m * Np;
        float *yr = (float *)(y + m * N);
        for (uint32_t n = 0; n < N; n++) yr[n] = (float)cr[n] * s; /* convert_w2sf, sfmpy: nearest even */
    }
}

void hvx_w8a8(const uint32_t *x, const uint32_t *smooth, const uint8_t *bp, uint32_t *y, int8_t *q, int32_t *ctile,
              uint32_t *xs, uint32_t M, uint32_t K, uint32_t N, uint32_t sa, uint32_t scale_out) {
    uint32_t Kp = (K + 3) & ~3u, Np = (N + 31) & ~31u;
    hvx_quantize(x, smooth, xs, sa, q, M, K, Kp);
    for (uint32_t m = 0; m < M; m += 4) {
        uint32_t rows = M - m < 4 ? M - m : 4;
        hvx_gemm_s8s32(q + m * Kp, bp, ctile, rows, Kp, Np);
        uint32_t t0 = hvx_packets_now();
        hvx_requantize(ctile, scale_out, y + m * N, rows, N, Np);
        hvx_scalar_packets += hvx_packets_now() - t0;
    }
}
