"""Where a batch-1 decode step's time goes on the agent: its ops, and the time between them.

A local agent decodes --steps greedy tokens after a --prompt-token prompt, the loop on the agent (one request for all
steps, as a phone's runtime loops) and, with --host-loop, on the host too (a round trip per token). From the trace:
the time in ops (each event's span; a fused op broken into its parts), a step's span on the agent minus that (the
overhead on the agent), and the host's wall time per step minus the time in ops (round trips, the reply and its trace
on top). The overhead on the agent is split by where it falls: before an op that waits for another lane's op (a
cross-lane hand-off: a thread wakes), before an op that follows one of its own lane, and between steps.
Schemes are measured in turns (A/B/A/B) so they see the same machine; the load average is printed with each turn.
--variant DIR adds a second agent whose edgeprobe_agent package comes from DIR (a patched copy of device_agent/ named
edgeprobe_agent), measured in turns with the installed one: an A/B of an agent change in one run. --kernels-from REV
builds such a folder holding edgeprobe_kernels as this tree has it but with every file a commit changed since REV as
it was at REV (the kernels before a change, A/B against the tree's). A q4_0-tile decode step runs wholly on the npu
lane, one fused op (edgeprobe.plan.ONE_LANE_DECODE); --split-lanes adds the row "q4_0-tile/split", its linears on the
npu lane and its other ops on the cpu lane, as steps ran before. --compiled-ab adds an agent whose w8a8 layers run op by
op (EDGEPROBE_COMPILED_LAYERS=0: device_agent/ops/compiled.py off), in turns with the compiled ones. Each row says
the bytes of linear weights its kernels read per token (the lm_head's included).

    .venv/bin/python bench/decode_overhead.py [--schemes q4_0-tile,w8a8] [--steps 16] [--rounds 2] [--host-loop]
        [--variant DIR | --kernels-from REV [--kernels-files F,G]] [--compiled-ab] [--split-lanes]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile

from timing import lane_gaps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_overhead(dec, steps: int) -> dict:
    """Per-step ms (medians over steps 1..n-1) of: time in ops, the step's span on the agent, the gaps before ops
    waiting on another lane, before ops following their own lane, between steps; and the host's wall per step."""
    by: dict = {}
    for e in dec.trace.events:
        g = e.get("group", "")
        if g.startswith("step") and g != "step0":
            by.setdefault(int(g[4:]), []).append(e)
    rows = []
    prev_end = None
    for i in sorted(by):
        evs = sorted(by[i], key=lambda e: e["start_us"])
        in_ops = sum(e["end_us"] - e["start_us"] for e in evs)
        span = evs[-1]["end_us"] - evs[0]["start_us"]
        cross, same, handoffs = lane_gaps(evs)
        between = evs[0]["start_us"] - prev_end if prev_end is not None else float("nan")
        prev_end = evs[-1]["end_us"]
        rows.append((in_ops, span, cross, same, between, len(evs), handoffs, len({e["lane"] for e in evs})))
    med = lambda k: statistics.median(r[k] for r in rows) / 1e3
    wall = dec.decode_s / steps * 1e3
    return {"in_ops": med(0), "span": med(1), "on_agent": med(1) - med(0), "cross_lane": med(2), "same_lane": med(3),
            "between_steps": statistics.median(r[4] for r in rows[1:]) / 1e3 if len(rows) > 1 else float("nan"),
            "ops": rows[0][5], "handoffs": rows[0][6], "lanes": rows[0][7], "wall": wall, "host": wall - med(0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default="q4_0-tile,w8a8")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--host-loop", action="store_true", help="also the loop on the host (a round trip per token)")
    ap.add_argument("--variant", help="a folder holding a patched edgeprobe_agent package: its agent runs in turns")
    ap.add_argument("--kernels-from", metavar="REV", help="a variant agent with the kernels files changed since REV "
                    "as they were at REV")
    ap.add_argument("--kernels-files", metavar="F,G", help="with --kernels-from: only these files of kernels/ "
                    "(others' later changes kept)")
    ap.add_argument("--compiled-ab", action="store_true",
                    help="a second agent with EDGEPROBE_COMPILED_LAYERS=0 (w8a8 layers op by op), in turns")
    ap.add_argument("--split-lanes", action="store_true",
                    help="also q4_0-tile's decode step split between the npu and cpu lanes, as steps ran before")
    args = ap.parse_args()
    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.device import Device
    from edgeprobe.prepare import prepared

    m = models.load("smollm2-135m")
    ids = m.tokenizer.encode(read_corpus("heldout"))[:args.prompt]
    schemes = [s for s in args.schemes.split(",") if s]
    if args.split_lanes and "q4_0-tile" in schemes:
        schemes.insert(schemes.index("q4_0-tile") + 1, "q4_0-tile/split")
    qms = {s: prepared(m, s.split("/")[0], say=print) for s in dict.fromkeys(schemes)}
    loops = ["agent"] + (["host"] if args.host_loop else [])
    how = {"agent": dict(loop="agent", logits="last"), "host": dict(loop="host")}
    got: dict = {}
    with contextlib.ExitStack() as stack:
        if args.kernels_from:  # the folder lives as long as the variant agent
            only = [f"kernels/{f}" for f in args.kernels_files.split(",")] if args.kernels_files else None
            args.variant = kernels_at(args.kernels_from, stack.enter_context(tempfile.TemporaryDirectory(
                prefix="decode-overhead-kernels-")), only)
        agents = {"installed": stack.enter_context(Device.local(store=stack.enter_context(tempfile.TemporaryDirectory(
            prefix="decode-overhead-"))))}
        if args.variant:  # the agent process imports edgeprobe_agent from the variant's folder first
            old = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(args.variant), old]))
            try:
                agents["variant"] = stack.enter_context(Device.local(store=stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="decode-overhead-"))))
            finally:
                os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)
        if args.compiled_ab:  # the agent reads it at start: layers op by op, in turns with the compiled ones
            os.environ["EDGEPROBE_COMPILED_LAYERS"] = "0"
            try:
                agents["sub-ops"] = stack.enter_context(Device.local(store=stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="decode-overhead-"))))
            finally:
                os.environ.pop("EDGEPROBE_COMPILED_LAYERS")
        for dev in agents.values():
            for s in schemes:
                for loop in loops:
                    with step_lanes(s):
                        dev.generate(qms[s], ids, 4, progress=False, **how[loop])  # upload, runners built, warm
        for r in range(args.rounds):
            for s in schemes:
                for loop in loops:
                    for agent, dev in agents.items():
                        load = os.getloadavg()[0]
                        with step_lanes(s):
                            d = dev.generate(qms[s], ids, args.steps, progress=False, **how[loop])
                        got.setdefault((s, loop, agent), []).append({**step_overhead(d, args.steps), "load": load})
    print(f"\nstreaming read of 256 MB on this machine (one thread, numpy sum): {stream_gbps():.2f} GB/s "
          f"[load {os.getloadavg()[0]:.1f}]")
    print(f"\nbatch-1 decode, {args.steps} steps after a {args.prompt}-token prompt, medians over steps and "
          f"{args.rounds} round(s) (ms per step; load average at each run in brackets)")
    for (s, loop, agent), runs in got.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        loads = ", ".join(f"{r['load']:.1f}" for r in runs)
        who = (f"{'kernels at ' + args.kernels_from if agent == 'variant' else 'kernels of the tree'}, "
               if args.kernels_from and agent != "sub-ops" else f"{agent} agent, "
               if args.variant or args.compiled_ab else "")
        mb = weight_bytes(qms[s], old=agent == "variant" and bool(args.kernels_from)
                          and not reads_codes(args.kernels_from)) / 1e6
        print(f"{s:<15} {who}weights read per token {mb:6.1f} MB: {mb / med['in_ops']:5.2f} GB/s over the time in ops")
        print(f"{s:<15} {who}loop on the {loop:<5}: wall {med['wall']:6.1f}, in ops {med['in_ops']:6.1f}, "
              f"outside ops on the agent {med['on_agent']:5.2f} (before {med['handoffs']} cross-lane hand-offs "
              f"{med['cross_lane']:5.2f}, after an op of the same lane {med['same_lane']:5.2f}; between steps "
              f"{med['between_steps']:.2f}), outside ops seen from the host {med['host']:5.2f}; {med['ops']} ops "
              f"on {med['lanes']} lane(s) a step [load {loads}]")


@contextlib.contextmanager
def step_lanes(scheme: str):
    """Plans built inside split a q4_0-tile decode step between the npu and cpu lanes when scheme is
    "q4_0-tile/split"; else they run it on the npu lane alone."""
    import edgeprobe.plan as plan

    old, plan.ONE_LANE_DECODE = plan.ONE_LANE_DECODE, not scheme.endswith("/split")
    try:
        yield
    finally:
        plan.ONE_LANE_DECODE = old


def kernels_at(rev: str, folder: str, only: list | None = None) -> str:
    """folder/edgeprobe_kernels: kernels/ of this tree, each file a commit changed since rev (of `only` where given)
    taken from rev."""
    shutil.copytree(os.path.join(ROOT, "kernels"), os.path.join(folder, "edgeprobe_kernels"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    changed = subprocess.run(["git", "diff", "--name-only", rev, "HEAD", "--", "kernels"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    changed = [p for p in changed if only is None or p in only]
    for path in changed:
        dst = os.path.join(folder, "edgeprobe_kernels", os.path.relpath(path, "kernels"))
        old = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True)
        if old.returncode:  # new since rev
            os.remove(dst) if os.path.exists(dst) else None
        else:
            with open(dst, "wb") as f:
                f.write(old.stdout)
    print(f"kernels at {rev}: {', '.join(changed) or 'no file changed'} restored in {folder}")
    return folder


def stream_gbps(mb: int = 256, repeats: int = 5) -> float:
    """The best of `repeats` sums over an mb-MB int64 array: this machine's one-thread streaming read rate."""
    import time

    import numpy as np

    a = np.ones(mb * 2**20 // 8, np.int64)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def reads_codes(rev: str) -> bool:
    """Whether the npu lane's q4_0-tile GEMV at rev reads the 4-bit codes (kernels/f16_gemm.py has gemv_q4_seq), not
    a float32 copy."""
    src = subprocess.run(["git", "show", f"{rev}:kernels/f16_gemm.py"], cwd=ROOT, capture_output=True, text=True)
    return "def gemv_q4_seq" in src.stdout


def weight_bytes(qm, old: bool = False) -> int:
    """Bytes of linear weights a decode step's kernels read: q4_0-tile's GEMV 4.5 bits a weight (its codes and FP16
    scales; old: the float32 k-major copy the npu lane read before), other records their blobs; plus the LM head."""
    import numpy as np

    from edgeprobe_kernels.linear_records import scheme_of, weight_blobs

    meta, total = qm.store.meta, 0
    for rec in qm.manifest["linears"].values():
        N, K = rec["shape"]
        if scheme_of(rec) == "q4_0-tile":
            total += N * K * 4 if old else N * K * 9 // 16
        else:
            total += sum(int(np.prod(meta[s]["shape"])) * np.dtype(meta[s]["dtype"]).itemsize
                         for s in weight_blobs(rec))
    head = qm.manifest.get("head") or {}
    total += sum(int(np.prod(meta[v]["shape"])) * np.dtype(meta[v]["dtype"]).itemsize
                 for k, v in head.items() if k in ("codes", "scales", "w") and v in meta)
    return total


if __name__ == "__main__":
    main()
