"""Decoding on the device agent: test-time scaling throughput by batch size (NPU TTS paper §3.2, Fig. 11).

One agent; for each batch size B the same prompt is prefilled once, forked into B sequences and decoded for
N steps with the tile-quantized weights (q4_0-tile on the emulated NPU lane). Prints tokens/s summed over the
batch (agent makespan per step, and host wall time with sampling and round trips), the ratio to B = 1, and a step's
time on the agent outside its ops (its span minus its ops' time: hand-offs between lanes; bench/decode_overhead.py
splits it).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--scheme", default="q4_0-tile")
    ap.add_argument("--split-lanes", action="store_true", help="a q4_0-tile decode step split between the npu and "
                    "cpu lanes, as before steps ran on the npu lane alone (edgeprobe.plan.ONE_LANE_DECODE)")
    ap.add_argument("--batches-only", action="store_true", help="skip the row-cut, neurons and experts sections")
    args = ap.parse_args()
    if args.split_lanes:
        import edgeprobe.plan

        edgeprobe.plan.ONE_LANE_DECODE = False
    from decode_overhead import step_overhead  # bench/, beside this script

    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.device import Device
    from edgeprobe.quant import quantize

    m = models.load("smollm2-135m")
    m.weights.materialize()
    ids = m.tokenizer.encode(read_corpus("heldout"))[:args.prompt]
    qm = quantize(m, args.scheme)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Device.local(store=tmp) as dev:
        dev.generate(qm, ids, 2, batch=2, progress=False)  # upload, first reads, warm runners
        for b in [int(x) for x in args.batches.split(",")]:
            d = dev.generate(qm, ids, args.steps, batch=b, temperature=0.8, seed=0, progress=False)
            step = statistics.median(d.step_ms[1:])
            rows.append((b, step, b / step * 1e3, d.decode_tok_per_s, step_overhead(d, args.steps)["on_agent"]))
        if not args.batches_only:
            rowcut(dev, m, ids, args.steps)
            neurons(dev, m, args.steps)
            experts(dev, args.steps)
    base = rows[0]
    print(f"decode on the agent, {args.scheme}{' (step split between lanes)' if args.split_lanes else ''}, prompt "
          f"{args.prompt}, {args.steps} steps (median step after the first)")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s (agent)':>14} {'x B=1':>6} {'tok/s (wall)':>13} {'x B=1':>6} "
          f"{'outside ops ms':>15}")
    for b, step, tps, wall, outside in rows:
        print(f"{b:5d} {step:8.1f} {tps:14.1f} {tps / base[2]:6.2f} {wall:13.1f} {wall / base[3]:6.2f} {outside:15.2f}")


def experts(dev, steps, capacity: int = 24, preload_n: int = 2) -> None:
    """EdgeMoE on the agent (tiny-moe): Fig. 16's ablation — float experts from flash on every use, INT4
    experts, + preloading (I/O lane), + expert buffer — per-token latency, bytes, and the buffer's hit rate
    beside the host simulator's on the same tokens' routing."""
    import dataclasses
    import statistics

    import numpy as np

    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.plan import attach_expert_streaming
    from edgeprobe.profile import run
    from edgeprobe.profile.expert_cache import preload_plan, simulate
    from edgeprobe.profile.experts import CoActivationStats, PreloadPredictor, record_routing
    from edgeprobe.quant import quantize

    m = models.load("tiny-moe")
    train, held = m.tokenizer.encode(read_corpus("train")), m.tokenizer.encode(read_corpus("heldout"))
    stats = run(m, train, CoActivationStats.for_model(m), window=256, max_tokens=32768, progress=False)
    pred = PreloadPredictor.from_stats(stats)
    fp, q4 = quantize(m, "float"), quantize(m, "moe-mixed", expert_bits={})  # moe-mixed, every expert INT4
    for qm in (fp, q4):
        attach_expert_streaming(qm, pred)
    prompt = held[500:532]
    rows = [("all experts resident (float)", fp, None),
            ("float experts from flash", fp, {"capacity": 0}),
            ("+ INT4 experts", q4, {"capacity": 0}),
            ("+ preloading (top-2, io lane)", q4, {"capacity": 0, "preload_n": preload_n}),
            (f"+ expert buffer ({capacity}, edgemoe)", q4,
             {"capacity": capacity, "policy": "edgemoe", "preload_n": preload_n}),
            (f"  buffer ({capacity}, lru)", q4, {"capacity": capacity, "policy": "lru", "preload_n": preload_n})]
    print(f"experts from flash on the agent: tiny-moe, prompt {len(prompt)}, {steps} decode steps")
    for name, qm, fl in rows:
        d = dev.generate(qm, prompt, steps, experts_flash=fl, progress=False)
        c = [x for x in d.step_counters[1:]]
        uses = sum(x.get("experts_uses", 0) for x in c)
        hits = sum(x.get("experts_hits", 0) for x in c)
        mb = statistics.mean(x.get("flash_read_bytes", 0) for x in c) / 1e6
        line = f"  {name:<32} {statistics.median(d.step_ms[1:]):6.1f} ms/token  {mb:6.2f} MB read/token"
        if fl is not None:
            line += f"  hit rate {100 * hits / max(uses, 1):5.1f}%"
            if fl.get("capacity"):  # the simulator on the routing of the same decoded tokens
                seq = np.concatenate([prompt, d.tokens[0]])
                tr = record_routing(m, seq, window=len(seq), progress=False)
                sub = dataclasses.replace(tr, experts=tr.experts[len(prompt) + 1:],
                                          weights=tr.weights[len(prompt) + 1:], starts=np.array([0]))
                plan = preload_plan(sub, pred, preload_n) if fl.get("preload_n") else None
                sim = simulate(sub, fl["policy"], capacity, pred.p0, plan)
                line += f" (simulator, cold buffer: {100 * sim['hit_rate']:.1f}%)"
        print(line)


def neurons(dev, m, steps) -> None:
    """LLM in a flash on the agent: FFN neurons from bundles on flash (predicted + sliding window) against
    dense loading from flash and against all-resident; bytes read and latency per token; perplexity cost."""
    import statistics
    import time

    from edgeprobe.corpus import read_corpus
    from edgeprobe.neurons import add_bundles, sparsity_perplexity
    from edgeprobe.profile.predictor import train_predictors
    from edgeprobe.profile.sparsity import calibrate_thresholds
    from edgeprobe.quant import quantize

    train, held = m.tokenizer.encode(read_corpus("train")), m.tokenizer.encode(read_corpus("heldout"))
    t = time.perf_counter()
    taus = calibrate_thresholds(m, train, eps=0.01, tokens=512)
    pred = train_predictors(m, train[:4096], held[:512], taus, rank=32, window=256, progress=False)
    print(f"neurons from flash: predictors trained in {time.perf_counter() - t:.0f} s (recall "
          f"{pred.recall.mean():.3f}, predicted active {100 * pred.predicted_fraction.mean():.1f}% of neurons)")
    ppl = sparsity_perplexity(m, pred, held[4096:], window=256, max_windows=4)
    print(f"  perplexity, 4 held-out windows of 256: dense {ppl['dense_ppl']:.3f}, "
          f"predicted-sparse {ppl['sparse_ppl']:.3f} (+{100 * ppl['ppl_increase']:.2f}%)")
    qm = quantize(m, "float")
    add_bundles(qm, m, pred)
    prompt = held[2000:2032]
    for name, mode in (("all resident", None), ("sparse + window 5", {"mode": "sparse", "window": 5}),
                       ("sparse + window 1", {"mode": "sparse", "window": 1}), ("dense from flash", {"mode": "dense"})):
        d = dev.generate(qm, prompt, steps, ffn_flash=mode, progress=False)
        mb = [c.get("flash_read_bytes", 0) / 1e6 for c in d.step_counters[1:]]
        print(f"  {name:<18} median step {statistics.median(d.step_ms[1:]):7.1f} ms   flash read per token "
              f"{statistics.mean(mb):8.2f} MB (max {max(mb):.2f})")


def rowcut(dev, m, ids, steps) -> None:
    """HeteroLLM decode: every int8 GEMV split by output channels between the gpu and npu lanes at the solver's
    ratio, against each lane alone (w8a8, batch 1)."""
    import statistics

    from edgeprobe.corpus import read_corpus
    from edgeprobe.quant import calibration_profile, quantize
    from edgeprobe.schedule import decode_choices

    if "gpu" not in dev.info.get("lanes", []):
        print("HeteroLLM decode row-cut: the agent has no gpu lane; skipped")
        return
    qm = quantize(m, "w8a8", calibration_profile(m, m.tokenizer.encode(read_corpus("train")), progress=False))
    hp, _ = dev.measure_linears(qm, rows=(1, 2, 4), progress=False)
    print(f"decode GEMV rates on the agent: npu {hp.npu_gops:.1f} GOP/s, gpu {hp.gpu_gflops:.1f} GFLOP/s, "
          f"slowdown when both run npu x{hp.slowdown_npu:.2f} gpu x{hp.slowdown_gpu:.2f}")
    res = {}
    for s in ("solver", "npu-pad", "gpu", "row-cut"):
        ch = decode_choices(m.config, 1, hp, s)
        d = dev.generate(qm, ids, steps, split=ch, progress=False)
        res[s] = statistics.median(d.step_ms[1:])
        cuts = sorted({f"{c.strategy}" + (f" {c.npu_cols}/{n}" if c.strategy == "row-cut" else "")
                       for n, c in ((k, v) for k, v in ch.items())})
        print(f"  {s:<8} median step {res[s]:6.1f} ms   ({', '.join(cuts)})")
    print(f"  solver vs npu alone {res['npu-pad'] / res['solver']:.2f}x, "
          f"vs gpu alone {res['gpu'] / res['solver']:.2f}x; "
          f"forced row-cut vs npu alone {res['npu-pad'] / res['row-cut']:.2f}x")


if __name__ == "__main__":
    main()
