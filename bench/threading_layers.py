"""numba's threading layer on the agent: decode steps under TBB against OpenMP, quiet and beside a busy process.

The agent's decode kernels are numba parallel loops over 2 cores. OpenMP (numba's default layer) splits each loop
statically and waits at its end for every thread's share; when another process holds one core, every one of a
step's ~150 loops waits for the scheduler to give that thread a turn. TBB steals work: the thread that runs takes
the rest. A host process gets TBB where the tbb wheel is installed (edgeprobe_kernels), the agent OpenMP at one
thread a lane and TBB with EDGEPROBE_LANE_THREADS=auto, which this bench sets (what it measured: see
device_agent/__main__.py); NUMBA_THREADING_LAYER overrides both.
Prints the median decode step (agent makespan, SmolLM2 w8a8, batch 1) per layer and load, rounds interleaved.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", default="w8a8")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spinners", type=int, default=2, help="CPU-bound processes beside the busy runs")
    args = ap.parse_args()
    os.environ.setdefault("EDGEPROBE_LANE_THREADS", "auto")  # a lone lane gets both cores, as in vs_llamacpp.py
    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.device import Device
    from edgeprobe.prepare import prepared

    m = models.load("smollm2-135m")
    ids = m.tokenizer.encode(read_corpus("heldout"))[:64]
    qm = prepared(m, args.scheme, say=print)
    res: dict = {}
    with tempfile.TemporaryDirectory() as store:
        for r in range(args.rounds):
            for layer in ("tbb", "omp"):
                os.environ["NUMBA_THREADING_LAYER"] = layer  # the agent's own choice under auto is tbb (its __main__)
                with Device.local(store=store) as dev:
                    assert dev.info["numba_threading"] == layer, dev.info["numba_threading"]
                    dev.generate(qm, ids, 4, progress=False)  # upload (first round), runners, JIT
                    for load in ("quiet", "busy"):
                        spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                                for _ in range(args.spinners if load == "busy" else 0)]
                        try:
                            d = dev.generate(qm, ids, args.steps, progress=False)
                        finally:
                            for p in spin:
                                p.kill()
                                p.wait()
                        res.setdefault((layer, load), []).append(statistics.median(d.step_ms[1:]))
                        print(f"round {r}: {layer:3s} {load:5s} {res[(layer, load)][-1]:8.1f} ms/step", flush=True)
    os.environ.pop("NUMBA_THREADING_LAYER", None)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"\n{args.scheme} decode step, median of {args.rounds} rounds (ms)   quiet     "
          f"beside {args.spinners} busy processes")
    for layer in ("tbb", "omp"):
        print(f"  {layer:3s}                                      "
              f"{med[(layer, 'quiet')]:8.1f}  {med[(layer, 'busy')]:8.1f}")
    print(f"  omp / tbb                                {med[('omp', 'quiet')] / med[('tbb', 'quiet')]:8.2f}x "
          f"{med[('omp', 'busy')] / med[('tbb', 'busy')]:8.2f}x")


if __name__ == "__main__":
    main()
