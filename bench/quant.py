"""Quantized arithmetic speed on the host, side by side in one run.

1. int8 x int8 -> int32 GEMM (edgeprobe_kernels.int8_gemm, numba) against numpy float32 GEMM (BLAS)
   on SmolLM2's shapes, M = 256 tokens: GOP/s each and the ratio.
2. A whole W8A8 linear as the agent's npu lane runs it (quantize x, int8 GEMM, scales): the AVX2 int8 kernel
   (int8_gemm.linear_w8a8_gemm) against the exact float32 BLAS path on the weight's float32 codes it replaced,
   at 64 and 256 rows; same bits (checked here too).
3. Prefill tokens/s at 256 tokens of the one forward pass under each scheme, float included.

    .venv/bin/python bench/quant.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import os

# as the agent: OpenBLAS's idle worker spins ~0.1 s after a call by default, taking a core from the numba kernel next
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")
import numpy as np  # noqa: E402
from timing import best_of

SHAPES = [(256, 576, 576), (256, 576, 192), (256, 576, 1536), (256, 1536, 576)]  # M, K, N


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from edgeprobe_kernels.int8_gemm import gemm_s8s32, gemm_s8s32_numba

    rng = np.random.default_rng(0)
    print(f"{'M x K x N':>18} {'int8 GOP/s':>11} {'numba GOP/s':>12} {'f32 GFLOP/s':>12} {'int8/f32':>9} "
          f"{'int8/numba':>11}")
    for M, K, N in SHAPES:
        a = rng.integers(-127, 128, (M, K), dtype=np.int8)
        bt = rng.integers(-127, 128, (K, N), dtype=np.int8)
        af, bf = a.astype(np.float32), bt.astype(np.float32)
        ops = 2 * M * K * N
        ti = best_of(lambda: gemm_s8s32(a, bt), args.repeat, warmup=True)
        tn = best_of(lambda: gemm_s8s32_numba(a, bt), args.repeat, warmup=True)
        tf = best_of(lambda: af @ bf, args.repeat, warmup=True)
        print(f"{M:>6} x {K:>4} x {N:>4} {ops / ti / 1e9:11.1f} {ops / tn / 1e9:12.1f} {ops / tf / 1e9:12.1f} "
              f"{tf / ti:9.2f} {tn / ti:11.2f}")

    from edgeprobe_kernels import int8_gemm

    if int8_gemm.GEMM_INT8:
        import numba

        print(f"\nW8A8 linear (quantize, GEMM, scale; best of {args.repeat}; "
              f"numba's {numba.threading_layer()} layer here; the agent runs OpenMP at one thread a lane, TBB with "
              "EDGEPROBE_LANE_THREADS=auto: NUMBA_THREADING_LAYER=omp to match the former):")
        print(f"{'M x K x N':>18} {'avx2 int8 ms':>13} {'f32 BLAS ms':>12} {'BLAS/avx2':>10}")
        for M in (64, 256):
            for _, K, N in SHAPES:
                x = rng.standard_normal((M, K)).astype(np.float32)
                bt = rng.integers(-127, 128, (K, N), dtype=np.int8)
                w, bf, scale = int8_gemm.rows_major(bt), int8_gemm.as_f32(bt), np.full(N, 3e-4, np.float32)
                blas = lambda: int8_gemm.gemm_codes_f32(int8_gemm.quantize_per_tensor_f32(x, 0.05), bf) * scale
                avx2 = lambda: int8_gemm.linear_w8a8_gemm(x, 0.05, w, scale)
                assert np.array_equal(blas(), avx2())
                ta, tb = best_of(avx2, args.repeat, warmup=True), best_of(blas, args.repeat, warmup=True)
                print(f"{M:>6} x {K:>4} x {N:>4} {ta * 1e3:13.2f} {tb * 1e3:12.2f} {tb / ta:10.2f}")

    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.errors import UnsupportedModelError
    from edgeprobe.quant import SCHEMES, calibration_profile, quantize

    m = models.load("smollm2-135m")
    m.weights.materialize()
    ids = m.tokenizer.encode(read_corpus("heldout"))[:256]
    profile = calibration_profile(m, m.tokenizer.encode(read_corpus("train")), tokens=1024, progress=False)
    print(f"\nprefill of 256 tokens on the host (best of {args.repeat}):")
    base = None
    for scheme in SCHEMES:
        try:
            qm = quantize(m, scheme, profile if scheme != "float" else None)
        except UnsupportedModelError as e:  # moe-mixed: per-expert widths, for MoE models only
            print(f"  {scheme:<12} not for this model: {str(e).split(';')[0]}")
            continue
        t = best_of(lambda: qm.forward(ids, logits="last"), args.repeat, warmup=True)
        base = base or t
        print(f"  {scheme:<12} {256 / t:8.1f} tok/s   {base / t:5.2f}x float")


if __name__ == "__main__":
    main()
