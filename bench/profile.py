"""Profiler cost, measured side by side in one run.

1. Overhead: time of the forward pass with OutlierStats / SparsityStats hooks over time without,
   on the same windows (logits skipped in both), interleaved, best of --repeat.
   Goal <= 1.25x, aim <= 1.10x.
2. Memory: peak RSS of a whole profile job over N and 4N tokens, each in a fresh process.
   Goal ratio <= 1.1 (state is constant in the number of tokens).

    .venv/bin/python bench/profile.py [--tokens 2048] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = """
import json, resource, sys
from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.profile.jobs import profile_outliers, profile_sparsity
m = models.load("smollm2-135m"); m.weights.materialize()
ids = m.tokenizer.encode(read_corpus("train"))
job = {"outliers": profile_outliers, "sparsity": profile_sparsity}[sys.argv[1]]
st = job(m, ids, tokens=int(sys.argv[2]), window=512, progress=False)
print(json.dumps({"tokens": st.tokens, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def overhead(tokens: int, repeat: int) -> None:
    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.forward import forward
    from edgeprobe.profile import OutlierStats, SparsityStats, calibrate_clips, calibrate_thresholds
    from edgeprobe.profile.runner import combine_hooks, windows

    m = models.load("smollm2-135m")
    m.weights.materialize()
    ids = m.tokenizer.encode(read_corpus("train"))
    chunks = windows(ids, 512, tokens)
    clips = calibrate_clips(m, ids, max_tokens=512, progress=False)
    taus = calibrate_thresholds(m, ids)
    profiles = {"outliers": OutlierStats.for_model(m, clips), "sparsity": SparsityStats.for_model(m, taus)}
    variants = {"plain": None, **{k: combine_hooks([p.hooks(m)]) for k, p in profiles.items()}}

    def timed(name):
        t = time.perf_counter()
        for c in chunks:
            for p in profiles.values():
                p.begin_window(c)
            forward(m, c, hooks=variants[name], logits="none")
        return time.perf_counter() - t

    for name in variants:  # warm-up: JIT, caches
        timed(name)
    best = {name: [] for name in variants}
    for _ in range(repeat):
        for name in variants:
            best[name].append(timed(name))
    base = min(best["plain"])
    print(f"overhead on {len(chunks) * 512} tokens (best of {repeat}, interleaved):")
    print(f"  plain forward           {base:7.2f} s")
    for name in profiles:
        t = min(best[name])
        print(f"  + {name:<21s} {t:7.2f} s   ratio {t / base:.3f}x  (goal <= 1.25, aim <= 1.10)")


def memory(tokens: int) -> None:
    print("peak RSS of a profile job, fresh process each:")
    for job in ("outliers", "sparsity"):
        rss = []
        for n in (tokens, 4 * tokens):
            r = subprocess.run([sys.executable, "-c", CHILD, job, str(n)], capture_output=True, text=True, check=True)
            rss.append(json.loads(r.stdout.strip().splitlines()[-1])["maxrss_mb"])
        print(f"  {job:<9s} N={tokens:>6d}: {rss[0]:7.0f} MB   4N={4 * tokens:>6d}: {rss[1]:7.0f} MB   "
              f"ratio {rss[1] / rss[0]:.3f}  (goal <= 1.1)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    overhead(args.tokens, args.repeat)
    memory(args.tokens)


if __name__ == "__main__":
    main()
