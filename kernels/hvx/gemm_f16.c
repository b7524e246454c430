/* The W4A16 linear's GEMM (q4_0-tile, NPU TTS paper §5): float16 activations times float16 weights, float32
 * sums. A phone runs it on HMX, which QEMU does not have; v67 HVX has no float vectors, so here it runs on
 * the scalar core. Every product of two float16 values is exact in float32, so only the order of the
 * additions decides the bits: each sum runs over k in order from 0, the order kernels/f16_gemm.py (the
 * numba backend) uses too, so the two backends agree bit for bit.
 */
#include "hvx_float.h"
#include "hvx_kernels.h"
#include "hvx_runtime.h"

void hvx_gemm_f16w(const uint32_t *x, const float *w, float *y, float *xh, uint32_t M, uint32_t K, uint32_t N) {
    uint32_t t0 = hvx_packets_now();
    for (uint32_t i = 0; i < M * K; i++) xh[i] = f32_from_bits(f16_to_f32(f32_to_f16(x[i]))); /* A16: round to f16 */
    for (uint32_t m = 0; m < M; m += 4) { /* 4 rows share each weight load; each row's sum stays in k order */
        const float *x0 = xh + m * K, *x1 = x0 + (m + 1 < M ? K : 0), *x2 = x0 + (m + 2 < M ? 2 * K : 0);
        const float *x3 = x0 + (m + 3 < M ? 3 * K : 0);
        for (uint32_t n = 0; n < N; n++) {
            const float *wn = w + n * K;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            for (uint32_t k = 0; k < K; k++) {
                float wk = wn[k];
                a0 += x0[k] * wk; /* exact product: a fused multiply-add rounds the same as mul then add */
                a1 += x1[k] * wk;
                a2 += x2[k] * wk;
                a3 += x3[k] * wk;
            }
            y[m * N + n] = a0;
            if (m + 1 < M) y[(m + 1) * N + n] = a1;
            if (m + 2 < M) y[(m + 2) * N + n] = a2;
            if (m + 3 < M) y[(m + 3) * N + n] = a3;
        }
    }
    hvx_scalar_packets += hvx_packets_now() - t0;
}
