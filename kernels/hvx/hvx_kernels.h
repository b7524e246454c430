/* The NPU-semantics kernels of the npu lane, as Hexagon HVX code (128-byte vectors, v67).
 * Each mirrors a numpy/numba reference in edgeprobe_kernels bit for bit; shapes are checked by the caller
 * (main.c) against the arena before any of these run.
 */
#ifndef EDGEPROBE_HVX_KERNELS_H
#define EDGEPROBE_HVX_KERNELS_H

#include <stdint.h>

#define HVX_BYTES 128
#define HVX_MAX_K 8192 /* per-channel smoothing divisors kept on the DSP */
#define HVX_OVERREAD 512 /* bytes past a vector-read input that must lie inside the arena */

/* c int32[M][Np] = a int8[M][Kp] @ B, B packed k-major in groups of 4: bp[(g*Np + n)*4 + j] = B[4g+j][n]
   (the layout vrmpy reads: 32 output columns x 4 inputs per vector). Kp % 4 == 0, Np % 32 == 0. */
void hvx_gemm_s8s32(const int8_t *a, const uint8_t *bp, int32_t *c, uint32_t M, uint32_t Kp, uint32_t Np);

/* q int8[M][Kp] = clip(rint(x / sa), -127, 127) for x float32[M][K] (x / smooth[k] first when smooth is
   given, SmoothQuant, written to xs float32[M][K]), zero in columns K..Kp-1 (mllm-NPU §3.3, eq. 1, int8 part;
   round half to even). x is read in whole vectors: up to 127 floats past its end must be readable. */
void hvx_quantize(const uint32_t *x, const uint32_t *smooth, uint32_t *xs, uint32_t sa, int8_t *q, uint32_t M,
                  uint32_t K, uint32_t Kp);
/* the 128 thresholds of a scale: level n starts at float bits t[n] (kept for the scales used last) */
const uint32_t *hvx_thresholds(uint32_t scale);

/* y float32[M][N] = float32(c) * scale for c int32 rows of stride Np (per-tensor requantization) */
void hvx_requantize(const int32_t *c, uint32_t scale, uint32_t *y, uint32_t M, uint32_t N, uint32_t Np);

/* W8A8 linear, what run_w8a8 computes: quantize, GEMM 4 rows at a time into ctile int32[4][Np], requantize.
   q: int8[M][Kp] scratch, xs: float32[M][K] scratch (smoothing). */
void hvx_w8a8(const uint32_t *x, const uint32_t *smooth, const uint8_t *bp, uint32_t *y, int8_t *q, int32_t *ctile,
              uint32_t *xs, uint32_t M, uint32_t K, uint32_t N, uint32_t sa, uint32_t scale_out);

/* Q4_0 tile super-blocks (kernels/tiles.py: 8 float16 scales, 128 bytes of nibbles) -> float16[S*256] through
   vlut16: one 16-entry table per group of 32, (i - 8) * d rounded to float16 (NPU TTS paper §5.1). */
void hvx_q4_tile_dequant(const uint8_t *blocks, uint16_t *out, uint32_t S);

/* y float32[M][N] = fp16(x) @ w^T, x float32[M][K] rounded to float16 here (into xh float32[M][K]), w float32[N][K]
   holding float16 values; sums in k order on the scalar core (the W4A16 GEMM, HMX's work on a phone) */
void hvx_gemm_f16w(const uint32_t *x, const float *w, float *y, float *xh, uint32_t M, uint32_t K, uint32_t N);

/* out[i] = table[x[i] & 0x7fff] for float16 bit patterns, n % 64 == 0, through vgather (NPU TTS paper §5.2) */
void hvx_exp_lut(const uint16_t *x, const uint16_t *table, uint16_t *out, uint32_t n);

#endif
