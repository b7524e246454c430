"""The agent's lanes beside llama.cpp on the same cores, the same model and the same tokens (issue 17).

llama.cpp runs through llama-cpp-python, built natively (GGML_NATIVE=ON) into a side environment the first time
(a few minutes of compiling; never part of `make test`): $EDGEPROBE_CACHE/llamacpp, else ~/.cache/edgeprobe/llamacpp.
It runs SmolLM2-135M's own GGUF (Q4_1 linears, Q8_0 embedding/head) on 2 threads in its own process, driven over
a pipe, or with --anchor a GGUF of the same model that llama.cpp's own quantizer (llama_model_quantize, requantize
allowed) makes from the shipped one into the side environment once: q8_0 (the bit width of our int8 schemes), q4_0;
--anchor both compares int8 and float schemes with Q8_0 and 4-bit ones with Q4_1, each row naming the GGUF it ran;
the agent is a local edgeprobe agent (npu lane: NPU semantics emulated with numba on this CPU). Each measurement
alternates the two, A/B/A/B, so both see the same machine.

    .venv/bin/python bench/vs_llamacpp.py [--repeats 3] [--lengths 64,256,1024]
        [--schemes w8a8-shadow,w8a8,q4_0-tile,float] [--anchor q4_1|q8_0|q4_0|both]

Prints, per scheme and prompt length: prefill tok/s of llama.cpp and of the agent, warm (model uploaded, one
prefill done; best of 2) and first run (a new agent process on a store that holds the blobs: its first prefill
reads them from flash and builds its runners; "first run" where an earlier run on that store kept the int8 weights'
row-major layouts in flash, as an installed app's would be, "first, no layouts" where the agent makes them); then
batch-1 decode, 64 greedy steps after a 64-token prompt: llama.cpp loops in its process (argmax of the logits, then one
token through the model), the agent's loop runs on the agent (decode@agent: argmax there, one request for all steps,
as a phone's runtime loops; the reply holds the tokens and the last step's logits, decode@agent+logits every step's
too) and on the host (decode@host: a round trip per token); the per-token time outside the agent's ops and one decode
step's profile for each. With --repeats N every ratio is the median of N rounds.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

LLAMA_VERSION = "0.3.36"

WORKER = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    from llama_cpp import Llama
    llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=2, n_threads_batch=2, n_batch=2048,
                n_ubatch=512, logits_all=False, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        toks = req["tokens"]
        llm.reset()
        t = time.perf_counter()
        llm.eval(toks)
        prefill_s = time.perf_counter() - t
        out = {"prefill_s": prefill_s}
        if req.get("steps"):
            fed = []
            t = time.perf_counter()
            for _ in range(req["steps"]):  # greedy: argmax of the last logits, then one token through the model
                last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))  # the last row's logits
                tok = int(np.argmax(last))
                fed.append(tok)
                llm.eval([tok])
            out.update(decode_s=time.perf_counter() - t, tokens=fed)
        print(json.dumps(out), flush=True)
''')


def cpu_stamp() -> str:
    """This CPU's model and feature flags: a GGML_NATIVE build compiles for the CPU it is built on."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    pick = lambda key: next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith(key)), "")
    return f"{pick('model name')}\n{pick('flags')}\n"


def side_env() -> Path:
    """The side environment's python with llama-cpp-python, built here when missing or built on another CPU (a
    native build for a CPU without AVX-512 VNNI would leave llama.cpp slower here than it is)."""
    root = Path(os.environ.get("EDGEPROBE_CACHE", Path.home() / ".cache" / "edgeprobe")) / "llamacpp"
    py = root / "bin" / "python"
    stamp = root / "built-for-cpu.txt"
    probe = [str(py), "-c", "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != %r)" % LLAMA_VERSION]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0 \
            and stamp.exists() and stamp.read_text() == cpu_stamp():
        return py
    print(f"building llama-cpp-python {LLAMA_VERSION} (GGML_NATIVE=ON) for this CPU into {root}: a few minutes, once",
          flush=True)
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON"}
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-cache-dir", f"llama-cpp-python=={LLAMA_VERSION}"],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"building llama-cpp-python failed (it needs cmake and a C++ compiler: apt-get install cmake g++):\n"
                 f"{r.stderr[-3000:]}")
    stamp.write_text(cpu_stamp())
    return py


# llama.cpp's file types (enum llama_ftype) of the anchors a row can run
FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7}

QUANTIZE = textwrap.dedent('''
    import ctypes, sys
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = int(sys.argv[3]), True, 2
    sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
''')


def gguf_ftype(path: Path) -> int | None:
    """general.file_type of a GGUF (llama_ftype), None where it does not say."""
    import gguf

    f = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    return int(f.parts[f.data[0]][0]) if f is not None else None


def anchor_gguf(shipped: Path, anchor: str) -> Path:
    """The GGUF llama.cpp runs for `anchor`: the shipped one where it already is that type, else one made from it by
    llama.cpp's own quantizer in the side environment, once (kept there, beside a note of its source)."""
    if gguf_ftype(shipped) == FTYPES[anchor]:
        return shipped
    py = side_env()
    out = py.parent.parent / "gguf" / f"{shipped.stem.rsplit('.', 1)[0]}.{anchor.upper()}.gguf"
    note = out.with_suffix(".source")
    src = f"{shipped} {shipped.stat().st_size} {shipped.stat().st_mtime_ns}"
    if out.exists() and note.exists() and note.read_text() == src:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    t = time.perf_counter()
    r = subprocess.run([str(py), "-c", QUANTIZE, str(shipped), str(tmp), str(FTYPES[anchor])], capture_output=True,
                       text=True)
    if r.returncode or not tmp.exists():
        sys.exit(f"llama_model_quantize to {anchor.upper()} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    tmp.replace(out)
    note.write_text(src)
    print(f"made {out.name} from {shipped.name} with llama.cpp's quantizer in {time.perf_counter() - t:.1f} s "
          f"({out.stat().st_size / 1e6:.0f} MB)", flush=True)
    return out


def anchor_for(scheme: str, anchor: str) -> str:
    """The anchor a scheme's rows run against: the one asked for, or with "both" the one of its bit width (4-bit
    schemes: Q4_1; int8 and float: Q8_0)."""
    if anchor != "both":
        return anchor
    return "q4_1" if scheme.startswith("q4") else "q8_0"


class LlamaCpp:
    """llama.cpp in its own process (the side environment), one request per line over a pipe."""

    def __init__(self, gguf: Path, n_ctx: int):
        py = side_env()
        self.gguf = gguf
        self._dir = tempfile.TemporaryDirectory(prefix="llamacpp-worker-")
        self.script = Path(self._dir.name) / "llamacpp_worker.py"
        self.script.write_text(WORKER)
        self.p = subprocess.Popen([str(py), str(self.script), str(gguf), str(n_ctx)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if not json.loads(self.p.stdout.readline()).get("ready"):
            raise RuntimeError("llama.cpp worker did not start")

    def run(self, tokens, steps: int = 0) -> dict:
        self.p.stdin.write(json.dumps({"tokens": [int(t) for t in tokens], "steps": steps}) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait(30)
        self._dir.cleanup()


def agent_prefill(dev, qm, tokens) -> tuple[float, float]:
    """(wall seconds of one prefill request seen from the host, the agent's makespan in seconds)."""
    t = time.perf_counter()
    r = dev.prefill(qm, tokens, progress=False)
    return time.perf_counter() - t, r.trace.metrics()["makespan_ms"] / 1e3


def decode_profile(dec, steps: int) -> tuple[dict, float, float]:
    """Per-kind ms of one decode step (fused layers broken into their parts), the per-step time outside ops seen
    from the host (the loop's wall time: request, reply and its trace included), and the same on the agent alone
    (from step 1's first event to the last step's last: the gaps between a step's ops and between steps)."""
    by: dict = {}
    n = 0
    lo, hi = float("inf"), 0.0
    for e in dec.trace.events:
        g = e.get("group", "")
        if not g.startswith("step") or g == "step0":
            continue
        n = max(n, int(g[4:]))
        lo, hi = min(lo, e["start_us"]), max(hi, e["end_us"])
        parts = e.get("parts_us") or {e["kind"]: e["end_us"] - e["start_us"]}
        for k, v in parts.items():
            by[k] = by.get(k, 0.0) + v / 1e3
        if e.get("parts_us"):
            by["(fused-op dispatch)"] = by.get("(fused-op dispatch)", 0.0) + (
                e["end_us"] - e["start_us"] - sum(parts.values())) / 1e3
    in_ops = sum(by.values()) / max(n, 1)
    outside = dec.decode_s / steps * 1e3 - in_ops
    on_agent = (hi - lo) / 1e3 / max(n, 1) - in_ops if n else float("nan")
    return {k: v / max(n, 1) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}, outside, on_agent


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="rounds; every ratio printed is their median")
    ap.add_argument("--lengths", default="64,256,1024")
    ap.add_argument("--schemes", default="w8a8-shadow,w8a8,q4_0-tile,float")
    ap.add_argument("--decode-schemes", default="w8a8,w8a8c-shadow,q4_0-tile")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-first-run", action="store_true", help="skip the first-run measurement (a new agent each)")
    ap.add_argument("--lane-threads", default="auto", choices=["auto", "1"],
                    help="auto: an agent op computing alone uses both cores, as llama.cpp's 2 threads do; 1: one "
                         "core per lane (the agent's default)")
    ap.add_argument("--anchor", default="q4_1", choices=["q4_1", "q8_0", "q4_0", "both"],
                    help="the GGUF llama.cpp runs: the shipped Q4_1 (default), a Q8_0 or Q4_0 made from it by "
                         "llama.cpp's quantizer (once, cached in the side environment), or both: int8 and float "
                         "schemes against Q8_0, 4-bit ones against Q4_1")
    args = ap.parse_args()
    os.environ["EDGEPROBE_LANE_THREADS"] = args.lane_threads  # the agents started below inherit it
    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.device import Device
    from edgeprobe.models import _smollm2_135m
    from edgeprobe.prepare import prepared

    lengths = [int(x) for x in args.lengths.split(",")]
    schemes = [s for s in args.schemes.split(",") if s]  # --schemes "": decode only
    m = models.load("smollm2-135m")
    ids = m.tokenizer.encode(read_corpus("heldout"))
    decode_schemes = [s for s in args.decode_schemes.split(",") if s]
    qms = {s: prepared(m, s, say=print) for s in dict.fromkeys(schemes + decode_schemes)}
    anchors = {s: anchor_for(s, args.anchor) for s in dict.fromkeys(schemes + decode_schemes)}
    shipped = _smollm2_135m()
    ggufs = {a: anchor_gguf(shipped, a) for a in dict.fromkeys(anchors.values())}
    workers = {a: LlamaCpp(g, max(lengths) + args.steps + 64) for a, g in ggufs.items()}
    # this harness's long-lived objects (modules, the models, their tokenizer) out of its GC's sight: its full
    # collections walked them in 40-50 ms every few runs, landing in whichever measurement was under way (the
    # agent does the same at its start; llama.cpp's loop makes no Python objects to collect)
    gc.freeze()
    rows: dict = {}  # (what, scheme, length, anchor) -> list of (llama tok/s, agent tok/s) per round
    extra: dict = {}
    tmp = tempfile.TemporaryDirectory(prefix="vs-llamacpp-")  # the agents' store: removed at the end
    store = tmp.name
    load = os.getloadavg()[0]
    try:
        for rnd in range(args.repeats):
            print(f"-- round {rnd + 1}/{args.repeats} (load average {os.getloadavg()[0]:.1f})", flush=True)
            for s in schemes:
                qm, llama = qms[s], workers[anchors[s]]
                if not args.no_first_run:  # a new agent on a store holding the blobs: its first prefill, cold
                    with Device.local(store=store) as dev:
                        dev.upload(qm, progress=False)
                    for n in lengths:
                        toks = ids[:n]
                        # first without the int8 layouts an earlier run keeps in flash (the agent makes them), then with
                        for what in ("first, no layouts", "first run"):
                            if what == "first, no layouts":
                                shutil.rmtree(Path(store) / "layouts", ignore_errors=True)
                            ll = llama.run(toks)  # llama.cpp's first eval of this length: warm process, fresh KV
                            with Device.local(store=store) as dev:
                                wall, _ = agent_prefill(dev, qm, toks)
                            rows.setdefault((what, s, n, anchors[s]), []).append((n / ll["prefill_s"], n / wall))
                with Device.local(store=store) as dev:
                    dev.upload(qm, progress=False)
                    for n in lengths:
                        toks = ids[:n]
                        agent_prefill(dev, qm, toks)  # warm: runners built, blobs resident
                        llama.run(toks)
                        a, b = [], []
                        for _ in range(2):  # A/B/A/B, best of 2 each
                            b.append(llama.run(toks)["prefill_s"])
                            a.append(agent_prefill(dev, qm, toks)[0])
                        rows.setdefault(("prefill warm", s, n, anchors[s]), []).append((n / min(b), n / min(a)))
            for s in decode_schemes:
                qm, llama = qms[s], workers[anchors[s]]
                prompt = ids[:64]
                # the loop on the agent hands back its tokens and the last step's logits, as llama.cpp's loop keeps
                # its logits in its process ("agent"), or every step's too ("agent+logits", 12.6 MB for 64 steps)
                lr, by_loop = [], {"agent": [], "agent+logits": [], "host": []}
                how = {"agent": dict(loop="agent", logits="last"), "agent+logits": dict(loop="agent"),
                       "host": dict(loop="host")}
                with Device.local(store=store) as dev:
                    for loop in by_loop:
                        dev.generate(qm, prompt, 4, progress=False, **how[loop])  # warm
                    for _ in range(2):  # A/B/A/B: llama.cpp, the loop on the agent, the loop on the host
                        lr.append(llama.run(prompt, args.steps))
                        for loop, runs in by_loop.items():
                            runs.append(dev.generate(qm, prompt, args.steps, progress=False, **how[loop]))
                ll_s = min(r["decode_s"] for r in lr)
                for loop, runs in by_loop.items():
                    best = min(runs, key=lambda x: x.decode_s)
                    rows.setdefault((f"decode@{loop}", s, 64, anchors[s]), []).append((args.steps / ll_s,
                                                                           args.steps / best.decode_s))
                    prof, outside, on_agent = decode_profile(best, args.steps)
                    extra.setdefault((s, loop), []).append((prof, outside, best.step_ms, on_agent))
                a, h, last = by_loop["agent+logits"][0], by_loop["host"][0], by_loop["agent"][0]
                same_bits = (a.tokens == h.tokens).all() and all((x == y).all() for x, y in zip(a.logits, h.logits)) \
                    and (last.tokens == h.tokens).all() and (last.logits[-1] == h.logits[-1]).all()
                ours = a.tokens[0].tolist()
                same = next((i for i, (x, y) in enumerate(zip(lr[0]["tokens"], ours)) if x != y), len(ours))
                print(f"   decode {s}: the loop on the agent and the loop on the host gave "
                      f"{'the same tokens and logits, bit for bit' if same_bits else 'DIFFERENT results'}; the first "
                      f"{same} of {args.steps} greedy tokens equal llama.cpp's ({anchors[s].upper()} weights there; "
                      "after the first difference the texts part)")
    finally:
        for w in workers.values():
            w.close()
        tmp.cleanup()
    print(f"\nllama.cpp {LLAMA_VERSION} (SmolLM2-135M, 2 threads) vs the edgeprobe agent (lane threads "
          f"{args.lane_threads}), same tokens, A/B interleaved; load average at start {load:.1f}, at the end "
          f"{os.getloadavg()[0]:.1f}; medians of {args.repeats} round(s)")
    for a, g in ggufs.items():
        print(f"   GGUF {a.upper()}: {g} ({'shipped' if g == shipped else 'made by llama_model_quantize'})")
    print(f"{'what':<20} {'scheme':<12} {'tokens':>6} {'GGUF':>5} {'llama.cpp tok/s':>16} {'agent tok/s':>12} "
          f"{'ratio':>7}")
    for (what, s, n, a), vals in rows.items():
        lt = statistics.median(v[0] for v in vals)
        at = statistics.median(v[1] for v in vals)
        ratio = statistics.median(v[1] / v[0] for v in vals)
        print(f"{what:<20} {s:<12} {n:>6} {a.upper():>5} {lt:16.1f} {at:12.1f} {ratio:6.2f}x")
    for (what, s, n, a), vals in rows.items():  # the goal: a first run within 1.5x of a warm one
        warm = rows.get(("prefill warm", s, n, a))
        if what.startswith("first") and warm:
            first_vs_warm = statistics.median(v[1] for v in warm) / statistics.median(v[1] for v in vals)
            print(f"   {what}, {s}, {n} tokens: {first_vs_warm:.2f}x the warm time")
    for (s, loop), runs in extra.items():
        prof, outside, step_ms, _ = runs[len(runs) // 2]
        print(f"\none decode step, {s}, loop on the {loop} (ms; fused layers broken into their parts): "
              + ", ".join(f"{k} {v:.2f}" for k, v in prof.items()))
        on_agent = (f", of which on the agent between its ops and steps {statistics.median(r[3] for r in runs):.2f} ms"
                    if loop.startswith("agent") else "")  # a host loop's steps are runs apart: round trips between
        print(f"   per-token time outside the agent's ops (round trips, sampling, dispatch between ops, the reply "
              f"and its trace): {statistics.median(r[1] for r in runs):.2f} ms{on_agent}; agent makespan per step "
              f"{statistics.median(step_ms[1:]):.2f} ms")

if __name__ == "__main__":
    main()
