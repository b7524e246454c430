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
        [--schemes w8a8-shadow,w8a8,q4_0-tile,float] [--anchor q4_1|q8_0|q4_0|both] [--batches 1,4,8,16]

Prints, per scheme and prompt length: prefill tok/s of llama.cpp and of the agent, warm (model uploaded, one prefill
done; best of 5 runs each up to 256 tokens, of 2 above, the two alternating: A/B/A/B), back to back (the same, each
side's runs in a row: B/B/A/A) and first run (a new agent process on a store that holds the blobs: its first prefill
reads them from flash and builds its runners; "first run" where an earlier run on that store kept the int8 weights'
row-major layouts in flash, as an installed app's would be, "first, no layouts" where the agent makes them); then
batch-1 decode, 64 greedy steps after a 64-token prompt: llama.cpp loops in its process (argmax of the logits, then
one token through the model), the agent's loop runs on the agent (decode@agent: argmax there, one request for all
steps, as a phone's runtime loops; the reply holds the tokens and the last step's logits, decode@agent+logits every
step's too) and on the host (decode@host: a round trip per token); the per-token time outside the agent's ops and
one decode step's profile for each. With --repeats N every ratio is the median of N rounds.
--batches 1,4,8,16 (--batches-only: nothing else) adds batched decode (NPU TTS paper): the prompt forked into N
sequences, one llama_decode / agent step of N tokens per step, the same sampling on both; tok/s and its ratio to N = 1.
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
    import llama_cpp as lc
    import numpy as np
    from ep_sampling import sample  # the agent's own sampling.py, copied beside this script
    from llama_cpp import Llama
    llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=2, n_threads_batch=2, n_batch=2048,
                n_ubatch=512, logits_all=False, verbose=False)
    # batched decode (a request of kind "batched"): the prompt prefilled once into sequence 0 of a second context on
    # the same model (Llama takes no n_seq_max; its own context keeps one sequence for the other requests), copied to
    # sequences 1..n-1 in a unified KV cache (as llama.cpp's batched example: the prompt's cells shared), then
    # `steps` llama_decode calls of n tokens each (sequence i at its next position, logits on every row)
    bctx, bkey = None, None

    def batched(req):
        global bctx, bkey
        toks, n, steps = req["tokens"], req["n"], req["steps"]
        key = (req["n_seq_max"], req["n_ctx"])
        if bkey != key:
            if bctx is not None:
                lc.llama_free(bctx)
            p = lc.llama_context_params.from_buffer_copy(llm.context_params)  # threads, batch sizes as llm's
            p.n_seq_max, p.n_ctx, p.kv_unified = key[0], key[1], True
            bctx, bkey = lc.llama_init_from_model(llm._model.model, p), key
            if not bctx:
                raise RuntimeError(f"llama_init_from_model failed for n_seq_max {key[0]}, n_ctx {key[1]}")
        mem, nv = lc.llama_get_memory(bctx), llm.n_vocab()
        lc.llama_memory_clear(mem, True)
        b = lc.llama_batch_init(max(len(toks), n), 0, 1)

        def decode(tokens, pos, seqs, outs):
            for i, (tk, ps, sq, o) in enumerate(zip(tokens, pos, seqs, outs)):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(tk), ps, 1, o
                b.seq_id[i][0] = sq
            b.n_tokens = len(tokens)
            if lc.llama_decode(bctx, b):
                raise RuntimeError("llama_decode failed")
            return np.ctypeslib.as_array(lc.llama_get_logits(bctx), shape=(sum(outs), nv)).copy()

        try:
            t = time.perf_counter()
            logits = decode(toks, range(len(toks)), [0] * len(toks), [0] * (len(toks) - 1) + [1])
            for i in range(1, n):
                lc.llama_memory_seq_cp(mem, 0, i, -1, -1)
            prefill_s = time.perf_counter() - t
            logits, rng, fed, step_s = np.repeat(logits, n, axis=0), np.random.default_rng(req["seed"]), [], []
            t = time.perf_counter()
            for k in range(steps):
                fed.append(sample(logits, req["temperature"], rng))
                t1 = time.perf_counter()
                logits = decode(fed[-1], [len(toks) + k] * n, range(n), [1] * n)
                step_s.append(time.perf_counter() - t1)
            decode_s = time.perf_counter() - t
        finally:
            lc.llama_batch_free(b)
        return {"prefill_s": prefill_s, "decode_s": decode_s, "step_s": step_s,
                "tokens": np.stack(fed, axis=1).tolist(), "n_seq_max": lc.llama_n_seq_max(bctx)}

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("kind") == "batched":
            print(json.dumps(batched(req)), flush=True)
            continue
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
        from edgeprobe_kernels import sampling  # the same draw on both sides of a batched decode

        shutil.copy(sampling.__file__, self.script.parent / "ep_sampling.py")
        self.p = subprocess.Popen([str(py), str(self.script), str(gguf), str(n_ctx)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if not json.loads(self.p.stdout.readline()).get("ready"):
            raise RuntimeError("llama.cpp worker did not start")

    def run(self, tokens, steps: int = 0) -> dict:
        self.p.stdin.write(json.dumps({"tokens": [int(t) for t in tokens], "steps": steps}) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def batched(self, tokens, n: int, steps: int, temperature: float, seed: int, n_seq_max: int, n_ctx: int) -> dict:
        """Prefill `tokens` once, copy it to n sequences, decode `steps` steps of n tokens in one llama_decode each
        (tokens drawn by sampling.sample at `temperature` with `seed`): {"step_s": each step's llama_decode seconds,
        "decode_s": the steps' wall seconds with sampling, "tokens": int[n][steps] fed, "n_seq_max"}."""
        self.p.stdin.write(json.dumps({"kind": "batched", "tokens": [int(t) for t in tokens], "n": n, "steps": steps,
                                       "temperature": temperature, "seed": seed, "n_seq_max": n_seq_max,
                                       "n_ctx": n_ctx}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker died during a batched decode of {n} sequences")
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait(30)
        self._dir.cleanup()


def pairs(n: int) -> int:
    """Runs of each side a warm prefill row takes the best of: 5 up to 256 tokens, where one run is 40-300 ms and a
    hiccup of this shared 2-vCPU machine moved a round's ratio by 20-30%, 2 above."""
    return 5 if n <= 256 else 2


def agent_prefill(dev, qm, tokens) -> tuple[float, float]:
    """(wall seconds of one prefill request seen from the host, the agent's makespan in seconds)."""
    t = time.perf_counter()
    r = dev.prefill(qm, tokens, progress=False)
    return time.perf_counter() - t, r.trace.metrics()["makespan_ms"] / 1e3


def decode_profile(dec, steps: int) -> tuple[dict, float, float, dict]:
    """Per-kind ms of one decode step (fused layers broken into their parts), the per-step time outside ops seen
    from the host (the loop's wall time: request, reply and its trace included), the same on the agent alone
    (from step 1's first event to the last step's last: the gaps between a step's ops and between steps), and how
    many of the steps' op events ran on how many threads (the thread policy's choice, the event's `threads`)."""
    by: dict = {}
    threads: dict = {}
    n = 0
    lo, hi = float("inf"), 0.0
    for e in dec.trace.events:
        g = e.get("group", "")
        if not g.startswith("step") or g == "step0":
            continue
        n = max(n, int(g[4:]))
        threads[e.get("threads", "?")] = threads.get(e.get("threads", "?"), 0) + 1
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
    return {k: v / max(n, 1) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}, outside, on_agent, threads


def batched_round(dev, qm, llama, prompt, batches: list, steps: int, temperature: float, rnd: int) -> dict:
    """One round of batched decode at each batch size, llama.cpp and the agent alternated (the one going first flips
    each round), the same prompt, steps, sampling rule and seed on both: {N: (llama.cpp tok/s, its wall tok/s,
    agent tok/s, its wall tok/s, load average)}; tok/s = N / median step after the first (llama_decode's time;
    the agent's makespan), wall = N * steps / the steps' time with sampling (and the agent's round trips). The
    slowest step is printed too: on busy cores llama.cpp's spinning thread barriers can stall one step for seconds."""
    n_ctx = len(prompt) + max(batches) * steps + 256  # unified KV: the prompt's cells shared, each sequence's own
    out = {}
    for n in batches:
        load = os.getloadavg()[0]
        sides = {"llama": lambda: llama.batched(prompt, n, steps, temperature, rnd, max(batches), n_ctx),
                 "agent": lambda: dev.generate(qm, prompt, steps, batch=n, temperature=temperature, seed=rnd,
                                               progress=False)}
        got = {k: sides[k]() for k in (("llama", "agent") if rnd % 2 == 0 else ("agent", "llama"))}
        ll, ag = got["llama"], got["agent"]
        row = (n / statistics.median(ll["step_s"][1:]), n * steps / ll["decode_s"],
               n / statistics.median(ag.step_ms[1:]) * 1e3, ag.decode_tok_per_s, load)
        out[n] = row
        ours = ag.tokens.tolist()
        same = sum(x[0] == y[0] for x, y in zip(ll["tokens"], ours))
        print(f"   batch {n:>2} (load average {load:.1f}): llama.cpp {row[0]:7.1f} tok/s (wall {row[1]:7.1f}), agent "
              f"{row[2]:7.1f} tok/s (wall {row[3]:7.1f}); slowest step llama.cpp {max(ll['step_s']) * 1e3:.0f} ms, "
              f"agent {max(ag.step_ms):.0f} ms; distinct sequences llama.cpp "
              f"{len({tuple(r) for r in ll['tokens']})}/{n}, agent {len({tuple(r) for r in ours})}/{n}; first "
              f"token the same in {same}/{n}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="rounds; every ratio printed is their median")
    ap.add_argument("--lengths", default="64,256,1024")
    ap.add_argument("--schemes", default="w8a8-shadow,w8a8,q4_0-tile,float")
    ap.add_argument("--decode-schemes", default=None,
                    help="decode rows' schemes (default w8a8,w8a8c-shadow,q4_0-tile; with --batches q4_0-tile)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-first-run", action="store_true", help="skip the first-run measurement (a new agent each)")
    ap.add_argument("--lane-threads", default="auto", choices=["auto", "1"],
                    help="auto: an agent op computing alone uses both cores, as llama.cpp's 2 threads do; 1: one "
                         "core per lane (the agent's default)")
    ap.add_argument("--anchor", default="q4_1", choices=["q4_1", "q8_0", "q4_0", "both"],
                    help="the GGUF llama.cpp runs: the shipped Q4_1 (default), a Q8_0 or Q4_0 made from it by "
                         "llama.cpp's quantizer (once, cached in the side environment), or both: int8 and float "
                         "schemes against Q8_0, 4-bit ones against Q4_1")
    ap.add_argument("--batches", default="", help="batched decode at these batch sizes (e.g. 1,4,8,16): the prompt "
                    "forked into N sequences, one llama_decode / agent step of N tokens per step")
    ap.add_argument("--batches-only", action="store_true", help="only the batched decode (no prefill or decode rows)")
    ap.add_argument("--batch-temperature", type=float, default=0.8,
                    help="batched decode's sampling on both sides (sampling.sample: 0 = argmax)")
    ap.add_argument("--batch-prompt", type=int, default=64, help="batched decode's prompt tokens")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",") if x]
    if args.batches_only and not batches:
        ap.error("--batches-only needs --batches")
    if batches and args.steps < 2:
        ap.error("batched decode needs --steps >= 2 (the first step is left out of the median)")
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
    picked = args.decode_schemes  # None: each section's default; "" (as before): no decode rows
    decode_schemes = [s for s in (picked if picked is not None else "w8a8,w8a8c-shadow,q4_0-tile").split(",") if s]
    batch_schemes = [s for s in (picked if picked is not None else "q4_0-tile").split(",") if s] if batches else []
    if args.batches_only:
        schemes, decode_schemes = [], []
    used = list(dict.fromkeys(schemes + decode_schemes + batch_schemes))
    qms = {s: prepared(m, s, say=print) for s in used}
    anchors = {s: anchor_for(s, args.anchor) for s in used}
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
    batched: dict = {}  # (scheme, N) -> list of batched_round's rows, one per round
    try:
        for rnd in range(args.repeats if schemes or decode_schemes else 0):
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
                        for _ in range(pairs(n)):  # A/B/A/B, best of pairs(n) each
                            b.append(llama.run(toks)["prefill_s"])
                            a.append(agent_prefill(dev, qm, toks)[0])
                        rows.setdefault(("prefill warm", s, n, anchors[s]), []).append((n / min(b), n / min(a)))
                        # each side's runs in a row: no run right after the other side's (docs/benchmarks.md)
                        b = [llama.run(toks)["prefill_s"] for _ in range(pairs(n))]
                        a = [agent_prefill(dev, qm, toks)[0] for _ in range(pairs(n))]
                        rows.setdefault(("prefill back to back", s, n, anchors[s]), []).append((n / min(b), n / min(a)))
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
                    prof, outside, on_agent, threads = decode_profile(best, args.steps)
                    extra.setdefault((s, loop), []).append((prof, outside, best.step_ms, on_agent, threads))
                a, h, last = by_loop["agent+logits"][0], by_loop["host"][0], by_loop["agent"][0]
                same_bits = (a.tokens == h.tokens).all() and all((x == y).all() for x, y in zip(a.logits, h.logits)) \
                    and (last.tokens == h.tokens).all() and (last.logits[-1] == h.logits[-1]).all()
                ours = a.tokens[0].tolist()
                same = next((i for i, (x, y) in enumerate(zip(lr[0]["tokens"], ours)) if x != y), len(ours))
                print(f"   decode {s}: the loop on the agent and the loop on the host gave "
                      f"{'the same tokens and logits, bit for bit' if same_bits else 'DIFFERENT results'}; the first "
                      f"{same} of {args.steps} greedy tokens equal llama.cpp's ({anchors[s].upper()} weights there; "
                      "after the first difference the texts part)")
        for s in batch_schemes:
            qm, llama, prompt = qms[s], workers[anchors[s]], ids[:args.batch_prompt]
            how = "argmax" if args.batch_temperature <= 0 else f"sampling at temperature {args.batch_temperature}"
            print(f"-- batched decode, {s} against llama.cpp on {llama.gguf.name}: prompt {len(prompt)} tokens, "
                  f"{args.steps} steps, {how} (sampling.sample on both sides)", flush=True)
            with Device.local(store=store) as dev:
                dev.generate(qm, prompt, 2, batch=2, progress=False)  # upload, first reads, warm runners
                print("   warm-up (the batched context made, the agent's batch plans put):")
                batched_round(dev, qm, llama, prompt, [max(batches)], 2, args.batch_temperature, 0)
                for rnd in range(args.repeats):
                    print(f"   round {rnd + 1}/{args.repeats} ({'llama.cpp' if rnd % 2 == 0 else 'agent'} first)")
                    for n, row in batched_round(dev, qm, llama, prompt, batches, args.steps, args.batch_temperature,
                                                rnd).items():
                        batched.setdefault((s, n), []).append(row)
    finally:
        for w in workers.values():
            w.close()
        tmp.cleanup()
    if batched:
        print_batched(batched, batch_schemes, batches, anchors, ggufs, shipped, args)
    if not rows:
        return
    print(f"\nllama.cpp {LLAMA_VERSION} (SmolLM2-135M, 2 threads) vs the edgeprobe agent (lane threads "
          f"{args.lane_threads}), same tokens, A/B interleaved; load average at start {load:.1f}, at the end "
          f"{os.getloadavg()[0]:.1f}; medians of {args.repeats} round(s)" +
          (f"; warm prefill: best of {'/'.join(str(pairs(n)) for n in lengths)} runs a side at "
           f"{'/'.join(map(str, lengths))} tokens" if schemes else ""))
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
        prof, outside, step_ms, _, threads = runs[len(runs) // 2]
        print(f"\none decode step, {s}, loop on the {loop} (ms; fused layers broken into their parts): "
              + ", ".join(f"{k} {v:.2f}" for k, v in prof.items()))
        print("   op events by the threads the policy gave them: "
              + ", ".join(f"{t} thread(s) {c}" for t, c in sorted(threads.items(), key=str)))
        on_agent = (f", of which on the agent between its ops and steps {statistics.median(r[3] for r in runs):.2f} ms"
                    if loop.startswith("agent") else "")  # a host loop's steps are runs apart: round trips between
        print(f"   per-token time outside the agent's ops (round trips, sampling, dispatch between ops, the reply "
              f"and its trace): {statistics.median(r[1] for r in runs):.2f} ms{on_agent}; agent makespan per step "
              f"{statistics.median(step_ms[1:]):.2f} ms")


def print_batched(batched: dict, schemes: list, batches: list, anchors: dict, ggufs: dict, shipped, args) -> None:
    """The batched-decode table: per scheme and batch size the medians over rounds of llama.cpp's and the agent's
    tok/s, each one's ratio to its batch 1, and agent / llama.cpp (the median of the rounds' ratios)."""
    how = "argmax" if args.batch_temperature <= 0 else f"sampling at temperature {args.batch_temperature}"
    for s in schemes:
        g = ggufs[anchors[s]]
        print(f"\nbatched decode, llama.cpp {LLAMA_VERSION} (2 threads, one llama_decode of N tokens per step, "
              f"unified KV cache) vs the agent ({s}, lane threads {args.lane_threads}): prompt {args.batch_prompt} "
              f"forked into N sequences, {args.steps} steps, {how} on both; medians of {args.repeats} round(s), A/B "
              "alternated")
        print(f"   GGUF {anchors[s].upper()}: {g} ({'shipped' if g == shipped else 'made by llama_model_quantize'})")
        print("   tok/s = N / median step after the first (llama.cpp: llama_decode; agent: its makespan); wall: "
              "N x steps / the steps' time with sampling (and the agent's round trips)")
        print(f"{'batch':>5} {'llama.cpp tok/s':>16} {'x B=1':>6} {'agent tok/s':>12} {'x B=1':>6} {'agent/llama':>12} "
              f"{'llama wall':>11} {'agent wall':>11} {'load':>9}")
        med = {n: [statistics.median(r[i] for r in batched[(s, n)]) for i in range(4)] for n in batches}
        b1 = med[batches[0]]
        for n in batches:
            rs = batched[(s, n)]
            loads = [r[4] for r in rs]
            print(f"{n:5d} {med[n][0]:16.1f} {med[n][0] / b1[0]:6.2f} {med[n][2]:12.1f} {med[n][2] / b1[2]:6.2f} "
                  f"{statistics.median(r[2] / r[0] for r in rs):11.2f}x {med[n][1]:11.1f} {med[n][3]:11.1f} "
                  f"{min(loads):4.1f}-{max(loads):.1f}")
        if batches[0] != 1:
            print(f"   (the x B=1 columns are ratios to batch {batches[0]}, the first asked for)")


if __name__ == "__main__":
    main()
