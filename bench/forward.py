"""Speed of the float32 reference forward pass: prefill tokens/s at 64/256/1024 tokens, decode tokens/s.

Also prints the BLAS float32 GEMM rate measured in the same run on the FFN shape, so the forward
pass can be read as a fraction of what this machine's BLAS does (ratios, not absolute figures,
are comparable across noisy shared machines). --baseline REV times the forward pass of that commit too
(toolkit/forward.py from git, loaded beside today's), each measurement alternating the two, and checks that
both give the same logits.

    .venv/bin/python bench/forward.py [--model smollm2-135m] [--repeat 3] [--baseline 60333cb]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
from timing import best_of

from edgeprobe import forward as current
from edgeprobe import models


def _baseline(rev: str) -> types.ModuleType:
    """toolkit/forward.py at `rev`, as a module of the edgeprobe package (its relative imports resolve today)."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:toolkit/forward.py"], cwd=root, capture_output=True, text=True,
                         check=True).stdout
    mod = types.ModuleType("edgeprobe._baseline_forward")
    mod.__package__ = "edgeprobe"
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{rev}:toolkit/forward.py", "exec"), mod.__dict__)
    return mod


def _decode(mod, m, steps: int, rng) -> float:
    """Seconds per decode step at context 64."""
    cache = mod.KVCache(m.config)
    mod.forward(m, rng.integers(0, m.config.vocab_size, 64), cache, logits="last")
    t = time.perf_counter()
    for _ in range(steps):
        mod.forward(m, rng.integers(0, m.config.vocab_size, 1), cache, logits="last")
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--baseline", help="a commit whose forward pass is timed too, alternating with today's")
    args = ap.parse_args()
    m = models.load(args.model)
    m.weights.materialize()
    c = m.config
    rng = np.random.default_rng(0)
    mods = {"now": current}
    if args.baseline:
        mods = {args.baseline: _baseline(args.baseline), "now": current}
        ids = rng.integers(0, c.vocab_size, 64)
        same = np.array_equal(mods[args.baseline].forward(m, ids), current.forward(m, ids))
        print(f"logits of {args.baseline} and now on 64 tokens: {'identical' if same else 'DIFFERENT'}")

    a = rng.standard_normal((256, c.hidden), dtype=np.float32)
    w = rng.standard_normal((c.ffn, c.hidden), dtype=np.float32)
    gemm = 2 * 256 * c.hidden * c.ffn / best_of(lambda: a @ w.T, 10) / 1e9
    flops_per_tok = 2 * (c.n_params() - (0 if c.tie_embeddings else c.vocab_size * c.hidden))

    print(f"model {m!r}")
    print(f"BLAS float32 GEMM 256x{c.hidden}x{c.ffn}: {gemm:.0f} GFLOP/s")
    print(f"{'code':>8s} {'phase':>14s} {'tokens':>7s} {'tok/s':>8s} {'GFLOP/s':>8s} {'of BLAS':>8s}")
    for mod in mods.values():
        mod.forward(m, rng.integers(0, c.vocab_size, 16))  # warm-up
    for T in (64, 256, 1024):
        ids = rng.integers(0, c.vocab_size, T)
        secs = {k: [] for k in mods}
        for _ in range(args.repeat):  # alternate: a burst of load on the machine hits both
            for k, mod in mods.items():
                secs[k].append(best_of(lambda: mod.forward(m, ids), 1))
        for k in mods:
            gf = flops_per_tok * T / min(secs[k]) / 1e9
            print(f"{k:>8s} {'prefill':>14s} {T:7d} {T / min(secs[k]):8.1f} {gf:8.1f} {gf / gemm:8.0%}")
    secs = {k: [] for k in mods}
    for _ in range(args.repeat):
        for k, mod in mods.items():
            secs[k].append(_decode(mod, m, args.decode_steps, rng))
    weight_bytes = sum(m.weights[n].nbytes for n in m.weights)
    for k in mods:
        s = min(secs[k])
        print(f"{k:>8s} {'decode (ctx64)':>14s} {1:7d} {1 / s:8.1f}   reads {weight_bytes / s / 1e9:.1f} GB/s of "
              "float32 weights")


if __name__ == "__main__":
    main()
