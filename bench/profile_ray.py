"""Profiling on Ray, measured side by side in one run: outlier-profile throughput of the same windows in one process
(BLAS on every core, and held to one BLAS thread as a Ray worker is), then on a local Ray cluster with 1 and with 2
workers (one CPU and one BLAS thread each), and what a shard costs beyond its windows. Best of --repeat each.

This machine has 2 cores shared with other work, so expect little from a second worker: it takes the core that one
process's second BLAS thread would use. The point of Ray is a cluster of many machines; the per-shard overhead says
how small a shard can be before the bookkeeping shows.

    .venv/bin/python bench/profile_ray.py [--tokens 2048] [--window 256] [--repeat 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

# one process's pass over the same windows, in a child whose BLAS the parent chose (OPENBLAS_NUM_THREADS)
CHILD = """
import json, sys, time
from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.profile import OutlierStats, calibrate_clips, run
W, N, repeat = (int(a) for a in sys.argv[1:4])
m = models.load("smollm2-135m"); m.weights.materialize()
ids = m.tokenizer.encode(read_corpus("train"))
clips = calibrate_clips(m, ids, window=W, max_tokens=W, progress=False)
run(m, ids, OutlierStats.for_model(m, clips), window=W, max_tokens=2 * W, progress=False)  # JIT and caches warm
best = float("inf")
for _ in range(repeat):
    t = time.perf_counter()
    run(m, ids, OutlierStats.for_model(m, clips), window=W, max_tokens=N, progress=False)
    best = min(best, time.perf_counter() - t)
print(json.dumps({"seconds": best}))
"""


def one_process(W: int, N: int, repeat: int, blas_threads: int | None) -> float:
    env = {**os.environ}
    if blas_threads:
        env["OPENBLAS_NUM_THREADS"] = str(blas_threads)
    r = subprocess.run([sys.executable, "-c", CHILD, str(W), str(N), str(repeat)], env=env, capture_output=True,
                       text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.profile import OutlierStats, calibrate_clips
    from edgeprobe.profile.cluster import RayRunner

    W, N, R = args.window, args.tokens, args.repeat
    n_win = N // W
    tokens = n_win * W
    m = models.load("smollm2-135m")
    ids = m.tokenizer.encode(read_corpus("train"))
    clips = calibrate_clips(m, ids, window=W, max_tokens=W, progress=False)

    def on_ray(runner, shards):
        runner.shards = shards
        best, st = float("inf"), None
        for _ in range(R):
            t = time.perf_counter()
            st = runner(m, ids, OutlierStats.for_model(m, clips), window=W, max_tokens=N, progress=False)
            best = min(best, time.perf_counter() - t)
        return best, st

    print(f"outlier profile of {n_win} windows x {W} tokens = {tokens} tokens (SmolLM2-135M), best of {R}")
    t_all = one_process(W, N, R, None)
    t_one = one_process(W, N, R, 1)
    print(f"  one process, BLAS on all cores       {t_all:6.2f} s  {tokens / t_all:5.0f} tok/s")
    print(f"  one process, one BLAS thread         {t_one:6.2f} s  {tokens / t_one:5.0f} tok/s   "
          "(a Ray worker's arithmetic)")
    times = {}
    for workers in (1, 2):
        t0 = time.perf_counter()
        with RayRunner("local", num_cpus=workers, say=lambda msg: None) as ray_run:
            start = time.perf_counter() - t0
            t = time.perf_counter()
            ray_run.shards = workers
            ray_run(m, ids, OutlierStats.for_model(m, clips), window=W, max_tokens=workers * W, progress=False)
            load = time.perf_counter() - t  # every worker loads the model once: not in the timings below
            times[workers], st = on_ray(ray_run, 2 * workers)
            assert st.tokens == tokens
            print(f"  ray, {workers} worker{'s' if workers > 1 else ' '}, {2 * workers} shards          "
                  f"{times[workers]:6.2f} s  {tokens / times[workers]:5.0f} tok/s   {t_one / times[workers]:.2f}x one "
                  f"thread, {t_all / times[workers]:.2f}x all cores (cluster start {start:.1f} s and first shards "
                  f"{load:.1f} s not counted)")
            if workers == 2:
                few, many = 2, n_win  # the same windows as 2 shards, or one shard per window
                t_few, _ = on_ray(ray_run, few)
                t_many, _ = on_ray(ray_run, many)
                per_shard = (t_many - t_few) / (many - few)
                one = st.to_bytes()
                t = time.perf_counter()
                for _ in range(5):
                    st.merge(OutlierStats.load(one))
                merge = (time.perf_counter() - t) / 5
                print(f"per-shard overhead, 2 workers: {few} shards {t_few:.2f} s, {many} shards {t_many:.2f} s -> "
                      f"{1e3 * per_shard:.0f} ms per extra shard (two workers side by side); decoding and merging "
                      f"one {len(one) / 1e6:.2f} MB answer on the driver: {1e3 * merge:.0f} ms")
    print(f"2 workers / 1 worker: {times[1] / times[2]:.2f}x  (2 shared cores: expect little)")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
