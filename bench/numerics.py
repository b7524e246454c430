"""Numerics op by op: what capture costs on the agent, and the divergence-by-depth figures.

1. Overhead: a layer-by-layer prefill on a local agent, plain and with every op captured (summaries only, and every
   op's whole tensor as well where they fit the capture's limit), rounds interleaved A/B/C so all three see the same
   machine. Prints the agent's makespan and the host's wall clock per run (medians) and their ratios to plain.
2. Figures: for each model and scheme, every op captured on a prefill and compared with the scheme's simulation
   and the float model; writes numerics.json, numerics.html and numerics.png (headless Chromium) under --out, and
   prints per scheme the first divergent op, the largest device-vs-simulation error and the scheme's price at the
   head (scheme vs float).

    .venv/bin/python bench/numerics.py [--lengths 64,256] [--rounds 3] [--models smollm2-135m,gemma3-270m]
        [--schemes w8a8,w8a8c-shadow,q4_0-tile] [--figure-tokens 32] [--out out/numerics]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def overhead(dev, qm, tokens, rounds: int) -> dict:
    """{"plain" | "summaries" | "whole": ([makespan ms], [wall ms])} over `rounds` interleaved rounds."""
    from edgeprobe.numerics import prefill_numerics

    runs = {"plain": lambda: dev.prefill(qm, tokens, progress=False),
            "summaries": lambda: prefill_numerics(dev, qm, tokens, full=[]),
            "whole": lambda: prefill_numerics(dev, qm, tokens)}
    for f in runs.values():  # warm: plans put, runners built
        f()
    out = {k: ([], []) for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            t0 = time.perf_counter()
            res = f()
            out[k][1].append((time.perf_counter() - t0) * 1e3)
            out[k][0].append(res.trace.metrics()["makespan_ms"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="64,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--schemes", default="w8a8,w8a8c-shadow,q4_0-tile")
    ap.add_argument("--figure-tokens", type=int, default=32)
    ap.add_argument("--out", default="out/numerics")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--no-figures", action="store_true")
    args = ap.parse_args()

    from edgeprobe import models
    from edgeprobe.browser import screenshot
    from edgeprobe.corpus import read_corpus
    from edgeprobe.device import Device
    from edgeprobe.numerics import prefill_numerics
    from edgeprobe.prepare import prepared

    print(f"load {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory() as tmp, Device.local(store=tmp) as dev:
        if not args.no_overhead:
            m = models.load("smollm2-135m")
            qm = prepared(m, "w8a8", progress=False)
            ids = m.tokenizer.encode(read_corpus("heldout"))
            print(f"\ncapture overhead, smollm2-135m w8a8, local agent, {args.rounds} interleaved rounds, medians "
                  "(makespan: the agent's; wall: the host's, with the host's references)")
            print(f"{'tokens':>6} | {'plain ms':>9} | {'summaries ms':>12} | {'whole ms':>9} | "
                  f"{'summaries/plain':>15} | {'whole/plain':>11} | {'wall s/p':>8} | {'wall w/p':>8}")
            for n in [int(x) for x in args.lengths.split(",")]:
                o = overhead(dev, qm, ids[:n], args.rounds)
                med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in o.items()}
                p = med["plain"]
                print(f"{n:>6} | {p[0]:>9.1f} | {med['summaries'][0]:>12.1f} | {med['whole'][0]:>9.1f} | "
                      f"{med['summaries'][0] / p[0]:>14.2f}x | {med['whole'][0] / p[0]:>10.2f}x | "
                      f"{med['summaries'][1] / p[1]:>7.2f}x | {med['whole'][1] / p[1]:>7.2f}x")
            print(f"load {os.getloadavg()[0]:.1f} after the overhead rounds")
        if args.no_figures:
            return
        out = Path(args.out)
        print(f"\ndivergence by depth, {args.figure_tokens}-token prefill, every op (files under {out})")
        print(f"{'model':<14} | {'scheme':<13} | {'ops':>4} | {'first divergent':<22} | "
              f"{'max dev-vs-sim rel L2 (op)':<40} | {'head: scheme vs float':>21}")
        for name in args.models.split(","):
            m = models.load(name)
            ids = m.tokenizer.encode(read_corpus("heldout"))[:args.figure_tokens]
            for scheme in args.schemes.split(","):
                qm = prepared(m, scheme, progress=False)
                rep = prefill_numerics(dev, qm, ids, float_model=m).numerics
                d = out / f"{name}-{scheme}"
                paths = rep.write(d)
                screenshot(paths["html"], d / "numerics.png", size=(1400, 800))
                worst = max(rep.ops, key=lambda r: r["device_vs_sim"]["rel_l2"])
                head = rep.by_name()["lm_head"].get("scheme_vs_float", {}).get("rel_l2", float("nan"))
                first = rep.first_divergent["op"] if rep.first_divergent else "none"
                print(f"{name:<14} | {scheme:<13} | {len(rep.ops):>4} | {first:<22} | "
                      f"{worst['device_vs_sim']['rel_l2']:.2e} ({worst['op']}){'':<{max(0, 27 - len(worst['op']))}}"
                      f" | {head:>21.3e}")


if __name__ == "__main__":
    main()
