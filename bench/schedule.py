"""Chunked prefill on the device agent: out-of-order (mllm-NPU eq. 6) against in-order, measured side by side.

One agent: first the subgraph cost model is measured on it (HeteroLLM's profiler, schedule.measure), then the
runs alternate in-order / ooo-over-the-measured-profile / ooo-over-the-modelled-host-profile so drift on this
shared machine hits all alike. Prints the makespans, the ratios (best of N and median), busy % and bubbles per
lane, and the predicted makespans beside the measured ones.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scheme", default="w8a8-shadow")
    ap.add_argument("--hetero-lengths", default="300,525,1000", help="unaligned prompt lengths for HeteroLLM's solver")
    args = ap.parse_args()
    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.device import Device
    from edgeprobe.quant import calibration_profile, quantize

    m = models.load("smollm2-135m")
    m.weights.materialize()
    ids = m.tokenizer.encode(read_corpus("heldout"))[:args.tokens]
    qm = quantize(m, args.scheme, calibration_profile(m, m.tokenizer.encode(read_corpus("train")), progress=False))
    runs = {"in-order": [], "ooo": [], "ooo-modelled": []}
    with tempfile.TemporaryDirectory() as tmp, Device.local(store=tmp) as dev:
        prof = dev.measure_profile(qm, ids, progress=False)  # also uploads, JITs, first flash reads
        err = prof.fit_error()
        print(f"measured profile: {len(prof.samples)} subgraph samples; "
              "predicted-mode error on held-out chunk lengths: "
              + ", ".join(f"{k} {100 * v['median']:.0f}%" for k, v in err.items() if k != "all")
              + f"; hand-off {prof.sync_us:.0f} us")
        for _ in range(args.repeat):
            for s in runs:
                p = "this-host-emulated" if s == "ooo-modelled" else prof
                runs[s].append(dev.prefill_chunked(qm, ids, args.chunk, s.split("-")[0] if s != "in-order" else s,
                                                   profile=p, progress=False))
        hetero(dev, qm, ids, [int(x) for x in args.hetero_lengths.split(",") if x])
    ms = {s: [r.trace.metrics()["makespan_ms"] for r in rs] for s, rs in runs.items()}
    print(f"chunked prefill {args.tokens} tokens / chunk {args.chunk}, {args.scheme}, "
          f"{args.repeat} alternating runs each")
    for s, rs in runs.items():
        best = min(rs, key=lambda r: r.trace.metrics()["makespan_ms"]).trace.metrics()
        lanes = "  ".join(f"{k} busy {v['busy_pct']:.0f}% bubbles {v['bubbles']} / {v['bubble_ms']:.0f} ms"
                          for k, v in best["lanes"].items())
        print(f"  {s:<12} makespan {' '.join(f'{x:7.0f}' for x in ms[s])} ms   predicted "
              f"{rs[0].schedule.makespan_us / 1e3:7.0f} ms   best run: {lanes}")
    for s in ("ooo", "ooo-modelled"):
        print(f"  {s} / in-order: best-of-{args.repeat} {min(ms[s]) / min(ms['in-order']):.3f}   "
              f"median {statistics.median(ms[s]) / statistics.median(ms['in-order']):.3f}   (goal <= 0.85)")


def hetero(dev, qm, ids, lengths) -> None:
    """HeteroLLM's partition solver on the agent's gpu (OpenCL) + npu (emulated) lanes against its baselines."""
    from edgeprobe.models import ModelConfig
    from edgeprobe.schedule import compare_strategies

    if "gpu" not in dev.info.get("lanes", []):
        print("HeteroLLM: the agent has no gpu lane (no OpenCL device); skipped")
        return
    hp, _ = dev.measure_linears(qm, progress=False)
    print(f"HeteroLLM profiler on the agent: npu {hp.npu_gops:.0f} GOP/s (+{hp.npu_launch_us:.0f} us), gpu "
          f"{hp.gpu_gflops:.0f} GFLOP/s (+{hp.gpu_launch_us:.0f} us), hand-off {hp.sync_us:.0f} us, "
          f"slowdown when both run: npu x{hp.slowdown_npu:.2f}, gpu x{hp.slowdown_gpu:.2f}")
    cfg = ModelConfig(**qm.manifest["config"])
    strategies = ("solver", "npu-pad", "pipe", "gpu", "row-cut", "seq-cut")
    for n in lengths:
        pred = compare_strategies(cfg, n, hp)
        dev.prefill_hetero(qm, ids[:n], hp, "solver", progress=False)  # warm: this length's shapes
        meas = {s: dev.prefill_hetero(qm, ids[:n], hp, s, progress=False).trace.metrics()["makespan_ms"]
                for s in strategies}
        picks = sorted({c["strategy"] for c in pred["choices"].values()})
        print(f"  {n:5d} tokens: solver picks {', '.join(picks)}; measured prefill ms "
              + "  ".join(f"{s} {t:.0f}" for s, t in meas.items())
              + f"   solver vs padding {meas['npu-pad'] / meas['solver']:.2f}x "
              f"(predicted {pred['speedup_vs_padding']:.2f}x), vs pipe {meas['pipe'] / meas['solver']:.2f}x "
              f"(predicted {pred['speedup_vs_pipe']:.2f}x)")


if __name__ == "__main__":
    main()
