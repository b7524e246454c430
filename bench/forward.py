"""Speed of the float32 reference forward pass: prefill tokens/s at 64/256/1024 tokens, decode tokens/s.

Also prints the BLAS float32 GEMM rate measured in the same run on the FFN shape, so the forward
pass can be read as a fraction of what this machine's BLAS does (ratios, not absolute figures,
are comparable across noisy shared machines).

    .venv/bin/python bench/forward.py [--model smollm2-135m] [--repeat 3]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from timing import best_of

from edgeprobe import models
from edgeprobe.forward import KVCache, forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    args = ap.parse_args()
    m = models.load(args.model)
    m.weights.materialize()
    c = m.config
    rng = np.random.default_rng(0)

    a = rng.standard_normal((256, c.hidden), dtype=np.float32)
    w = rng.standard_normal((c.ffn, c.hidden), dtype=np.float32)
    gemm = 2 * 256 * c.hidden * c.ffn / best_of(lambda: a @ w.T, 10) / 1e9
    flops_per_tok = 2 * (c.n_params() - (0 if c.tie_embeddings else c.vocab_size * c.hidden))

    print(f"model {m!r}")
    print(f"BLAS float32 GEMM 256x{c.hidden}x{c.ffn}: {gemm:.0f} GFLOP/s")
    print(f"{'phase':>14s} {'tokens':>7s} {'tok/s':>8s} {'GFLOP/s':>8s} {'of BLAS':>8s}")
    forward(m, rng.integers(0, c.vocab_size, 16))  # warm-up
    for T in (64, 256, 1024):
        ids = rng.integers(0, c.vocab_size, T)
        secs = best_of(lambda: forward(m, ids), args.repeat)
        gf = flops_per_tok * T / secs / 1e9
        print(f"{'prefill':>14s} {T:7d} {T / secs:8.1f} {gf:8.1f} {gf / gemm:8.0%}")
    cache = KVCache(c)
    forward(m, rng.integers(0, c.vocab_size, 64), cache, logits="last")
    t = time.perf_counter()
    for _ in range(args.decode_steps):
        forward(m, rng.integers(0, c.vocab_size, 1), cache, logits="last")
    secs = (time.perf_counter() - t) / args.decode_steps
    weight_bytes = sum(m.weights[n].nbytes for n in m.weights)
    print(f"{'decode (ctx64)':>14s} {1:7d} {1 / secs:8.1f}   "
          f"reads {weight_bytes / secs / 1e9:.1f} GB/s of float32 weights")


if __name__ == "__main__":
    main()
