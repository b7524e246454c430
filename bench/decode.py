"""Decoding on the device agent: test-time scaling throughput by batch size (NPU TTS paper §3.2, Fig. 11).

One agent; for each batch size B the same prompt is prefilled once, forked into B sequences and decoded for
N steps with the tile-quantized weights (q4_0-tile on the emulated NPU lane). Prints tokens/s summed over the
batch (agent makespan per step, and host wall time with sampling and round trips) and the ratio to B = 1.
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
    args = ap.parse_args()
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
            rows.append((b, step, b / step * 1e3, d.decode_tok_per_s))
    base = rows[0]
    print(f"decode on the agent, {args.scheme}, prompt {args.prompt}, {args.steps} steps (median step after the first)")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s (agent)':>14} {'x B=1':>6} {'tok/s (wall)':>13} {'x B=1':>6}")
    for b, step, tps, wall in rows:
        print(f"{b:5d} {step:8.1f} {tps:14.1f} {tps / base[2]:6.2f} {wall:13.1f} {wall / base[3]:6.2f}")


if __name__ == "__main__":
    main()
