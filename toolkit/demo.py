"""The main job, as a library call: `edgeprobe.demo.run_demo()` (also `edgeprobe demo`, `make demo`).

Corpus to timeline on a real model and a real (local) device agent:
  1. SmolLM2-135M, held-out perplexity;
  2. activation outliers and FFN sparsity profiled on the bundled training corpus (mllm-NPU Fig. 10-12);
  3. quantized (w8a8-shadow, mllm-NPU §3.3), the accuracy table beside float / w8a8 / w8a8c-shadow (per-channel
     weight scales, every outlier in float) / q4_0-tile;
  4. a 1024-token prompt cut into 256-token chunks, scheduled in-order and out-of-order (§3.4) over the cost
     model measured on the agent, run both ways on the agent;
  5. out/report.html (self-contained: figures, tables, predicted and measured timelines) and out/trace.json
     (Chrome trace of the out-of-order run; opens in Perfetto), plus a summary table printed.
Profiles, the accuracy table, the measured cost model and the agent's blob store are cached under
out/.cache, so a second run skips that work; the quantized models come from the prepared-model cache
(edgeprobe.prepare) that `edgeprobe run`, `quantize --report` and the Python API share.
"""
from __future__ import annotations

import html
import json
import shutil
import time
from pathlib import Path

import numpy as np

from . import models
from .corpus import read_corpus
from .errors import EdgeprobeError
from .evaluate import perplexity

FREE_BYTES_NEEDED = 1_500_000_000  # agent store (~0.3 GB), profiles, report; with margin


class DemoError(EdgeprobeError, RuntimeError):
    """The demo cannot run here (disk, ports); the message says what to do."""


def _cached(path: Path, make, load, save):
    if path.exists():
        try:
            return load(path), True
        except Exception:  # a cache left half-written by an interrupted run: recompute it
            path.unlink(missing_ok=True)
    v = make()
    tmp = path.with_suffix(path.suffix + ".tmp")
    save(v, tmp)
    tmp.replace(path)
    return v, False


_JSON_IO = (lambda p: json.loads(p.read_text()), lambda v, p: p.write_text(json.dumps(v)))  # load, save for _cached


ACCURACY_SCHEMES = ["float", "w8a8", "w8a8-shadow", "w8a8c-shadow", "q4_0-tile"]


def run_demo(model: str = "smollm2-135m", out: str | Path = "out", prompt_len: int = 1024, chunk: int = 256,
             profile_tokens: int = 8192, eval_windows: int | None = 8, accuracy_windows: int = 4,
             print_fn=print, progress: bool = True, repeats: int = 2) -> dict:
    from .graph import GRAPH_VERSION
    from .prepare import prepared
    from .profile.jobs import profile_outliers, profile_sparsity
    from .profile.outliers import OutlierStats
    from .profile.sparsity import SparsityStats
    from .quant.report import accuracy_table
    from .schedule import ScheduleError, chunk_graph, predicted_schedule
    from .schedule.measure import MeasuredCostModel

    if not isinstance(repeats, int) or repeats < 1:
        raise DemoError(f"repeats must be a positive number of runs per scheduler, got {repeats!r}")
    t_start = time.perf_counter()
    out = Path(out)
    cache = out / ".cache"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DemoError(f"cannot create {cache}: {e}; run the demo from a writable folder") from None
    free = shutil.disk_usage(cache).free
    if free < FREE_BYTES_NEEDED:
        raise DemoError(f"only {free / 1e9:.2f} GB free under {cache.resolve()}; the demo needs about "
                        f"{FREE_BYTES_NEEDED / 1e9:.1f} GB (agent store, profiles, report): free some space or pass "
                        "out=")
    timings: dict = {}

    def step(name):
        timings[name] = time.perf_counter()

    step("load")
    m = models.load(model)
    m.weights.materialize()
    train = m.tokenizer.encode(read_corpus("train"))
    held = m.tokenizer.encode(read_corpus("heldout"))
    if len(held) < prompt_len:
        raise DemoError(f"the held-out corpus has {len(held)} tokens, fewer than the {prompt_len}-token prompt")
    try:  # a bad prompt or chunk length must fail now, not after minutes of profiling
        chunk_graph(m.config, prompt_len, chunk, shadow=False)
    except ScheduleError as e:
        raise DemoError(str(e)) from None
    print_fn(f"model       {m!r}")
    step("perplexity")
    tag = Path(model).name  # caches are per model: a second model must not read the first one's numbers
    ev, hit_e = _cached(cache / f"{tag}-eval-{eval_windows}.json",
                    lambda: perplexity(m, held, window=512, max_windows=eval_windows, progress=progress).__dict__,
                    *_JSON_IO)
    print_fn(f"held-out    perplexity {ev['perplexity']:.3f} over {ev['tokens_scored']} tokens"
             f"{' (cached)' if hit_e else ''}")
    step("profiles")
    # v3: the profile also holds the p99.1 clips w8a8c-shadow quantizes with
    outl, hit_o = _cached(cache / f"{tag}-outliers-{profile_tokens}-v3.npz",
                          lambda: profile_outliers(m, train, tokens=profile_tokens, window=512,
                                                   calib_tokens=profile_tokens, progress=progress),
                          OutlierStats.load, lambda v, p: v.save(p))
    spar, hit_s = _cached(cache / f"{tag}-sparsity-{profile_tokens // 2}.npz",
                          lambda: profile_sparsity(m, train, tokens=profile_tokens // 2, window=512, progress=progress),
                          SparsityStats.load, lambda v, p: v.save(p))
    osum = outl.summary()
    print_fn(f"profiles    {outl.tokens:,} tokens for outliers, {spar.tokens:,} for sparsity"
             f"{' (cached)' if hit_o and hit_s else ''}")
    step("accuracy")
    kept: dict = {}  # the table's quantized models: its w8a8-shadow is the one the agent runs

    def prepare(scheme):  # from the prepared-model cache run, quantize --report and the Python API share
        return prepared(m, scheme, progress, say=lambda msg: print_fn(f"prepare     {msg}"))

    # v4: the schemes come from the shared prepared-model cache (its calibration), not from the outlier profile
    acc, hit_a = _cached(cache / f"{tag}-accuracy-{accuracy_windows}-v4.json",
                         lambda: accuracy_table(m, held, None, ACCURACY_SCHEMES, window=256,
                                                max_windows=accuracy_windows, progress=progress, quantized=kept,
                                                prepare=prepare),
                         *_JSON_IO)
    print_fn(f"accuracy    {', '.join(r['scheme'] for r in acc)} on {accuracy_windows} held-out windows of 256"
             f"{' (cached)' if hit_a else ''}")
    step("quantize")
    qm = kept.get("w8a8-shadow") or prepare("w8a8-shadow")
    tokens = np.asarray(held[:prompt_len], np.int32)
    step("agent")
    with _local_agent(cache / "agent-store", print_fn) as dev:
        # the cost model is fitted on the template's FLOPs: a new template version measures again; it is measured
        # at the chunk length the prefill runs and two shorter ones (64, 128, 256 for the default 256)
        # (the file keeps its first name, "-profile-", so a cost model measured before is found)
        # (-p: measured on the prepared-cache model, whose shadow layers differ from the old outlier-profile one's)
        cost_path = cache / f"{tag}-profile-w8a8-shadow-p-c{chunk}-g{GRAPH_VERSION}.json"
        chunks = tuple(sorted({max(4, chunk // 4), max(4, chunk // 2), max(4, chunk)}))
        cost, hit_p = _cached(cost_path, lambda: dev.measure_cost_model(qm, held, chunks=chunks, progress=progress),
                              MeasuredCostModel.from_json, lambda v, p: v.to_json(p))
        print_fn(f"agent       {dev.url}: lanes {', '.join(dev.info['lanes'])} (npu emulated); cost model "
                 f"{'cached' if hit_p else 'measured'}")
        # the prediction run and schedule make (schedule.predicted_schedule), over the measured cost model
        predicted = {s: predicted_schedule(qm.manifest, prompt_len, chunk, s, cost) for s in ("in-order", "ooo")}
        graph = predicted["ooo"][0]
        predicted = {s: p[1] for s, p in predicted.items()}
        dev.prefill_chunked(qm, tokens[:chunk], chunk, "in-order", cost_model=cost, progress=progress)  # warm
        # best of `repeats` alternating runs per scheduler: one run on two shared cores swings by ±15%
        runs: dict = {"in-order": [], "ooo": []}
        for _ in range(repeats):
            for s in runs:
                runs[s].append(dev.prefill_chunked(qm, tokens, chunk, s, cost_model=cost, progress=False))
        measured = {s: min(rs, key=lambda r: r.trace.metrics()["makespan_ms"]) for s, rs in runs.items()}
    step("report")
    mk = {s: r.trace.metrics() for s, r in measured.items()}  # of the kept runs
    ratio = mk["ooo"]["makespan_ms"] / mk["in-order"]["makespan_ms"]
    # the spread over the repeats: each repeat's out-of-order run over the in-order run beside it
    pair_ratios = [o.trace.metrics()["makespan_ms"] / i.trace.metrics()["makespan_ms"]
                   for i, o in zip(runs["in-order"], runs["ooo"])]
    mem = graph.memory()
    out.mkdir(parents=True, exist_ok=True)
    trace_path = measured["ooo"].trace.to_chrome_json(out / "trace.json")
    summary = {
        "model": model, "perplexity_heldout": round(ev["perplexity"], 3),
        "perplexity_windows": ev["windows"], "perplexity_window": ev["window"],
        "accuracy_windows": accuracy_windows, "accuracy_window": 256,
        "outlier_channels_pct": round(osum["fig10_outlier_channels_pct_mean"], 3),
        "channels_for_80pct_outliers_pct": round(osum["fig11_pct_channels_for_80pct_outliers"], 2),
        "ffn_inactive_fraction": round(float(np.mean(spar.inactive_fraction())), 4),
        "accuracy": {r["scheme"]: {"perplexity": round(r["perplexity"], 3), "delta_vs_float_pct":
                                   None if r["delta_vs_float_pct"] is None else round(r["delta_vs_float_pct"], 2)}
                     for r in acc},
        "prompt_len": prompt_len, "chunk": chunk, "repeats": repeats,
        "in_order_ms": round(mk["in-order"]["makespan_ms"], 1), "ooo_ms": round(mk["ooo"]["makespan_ms"], 1),
        "ooo_vs_in_order": round(ratio, 3), "ooo_vs_in_order_repeats": [round(r, 3) for r in pair_ratios],
        "predicted_in_order_ms": round(predicted["in-order"].makespan_us / 1e3, 1),
        "predicted_ooo_ms": round(predicted["ooo"].makespan_us / 1e3, 1),
        "busy_pct_ooo": {k: round(v["busy_pct"], 1) for k, v in mk["ooo"]["lanes"].items()},
        "busy_pct_in_order": {k: round(v["busy_pct"], 1) for k, v in mk["in-order"]["lanes"].items()},
        "chunk_shared_memory_saving": round(mem["saving"], 3),
        "report": str(out / "report.html"), "trace": str(trace_path), "timeline": str(out / "timeline.html"),
    }
    write_report(out / "report.html", m, outl, spar, acc, predicted, measured, summary)
    measured["ooo"].trace.figure(f"measured on the agent: {prompt_len}-token prefill in {chunk}-token chunks, "
                                 "out-of-order (npu lane emulated)").write_html(str(out / "timeline.html"),
                                                                                include_plotlyjs=True)
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for line in summary_lines(summary):
        print_fn(line)
    return summary


def _local_agent(store: Path, print_fn):
    """A local agent on the demo's cached store — or, when another agent holds that store (a demo still running,
    or one left behind), on a temporary store of its own: slower (uploads again), never stuck."""
    import tempfile

    from .device import Device, DeviceError
    from .local_agent import store_held

    if not store_held(store):  # held now: go elsewhere at once (an agent given a held store waits 10 s, then refuses)
        try:
            return Device.local(store=store, startup_timeout_s=90)
        except DeviceError as e:  # taken since: the same way out
            if "in use by another agent" not in str(e):
                raise
    tmp = Path(tempfile.mkdtemp(prefix="edgeprobe-demo-store-"))
    print_fn(f"agent       {store} is held by another agent; this run uploads to a temporary store {tmp}")
    dev = Device.local(store=tmp)
    dev.temp_store = tmp
    return dev


def summary_rows(s: dict) -> list[tuple[str, str]]:
    # two float perplexities on different windows: say which, so 13.6 and 14.7 do not look like a contradiction
    ev_win = f", {s['perplexity_windows']} × {s['perplexity_window']} tokens" if "perplexity_windows" in s else ""
    acc_win = (f" ({s['accuracy_windows']} × {s['accuracy_window']}; shorter windows, less context, higher perplexity)"
               if "accuracy_windows" in s else "")
    rows = [(f"held-out perplexity (float{ev_win})", f"{s['perplexity_heldout']:.3f}"),
            ("outlier channels per layer (Fig. 10)", f"{s['outlier_channels_pct']:.2f}% of channels"),
            ("channels holding 80% of outliers", f"{s['channels_for_80pct_outliers_pct']:.2f}%"),
            ("FFN neurons inactive at 1% error", f"{100 * s['ffn_inactive_fraction']:.1f}%")]
    for scheme, r in s["accuracy"].items():
        d = r["delta_vs_float_pct"]
        rows.append((f"perplexity {scheme}", f"{r['perplexity']:.3f}" + ("" if d is None else f" ({d:+.2f}%)")
                     + (acc_win if scheme == "float" else "")))
    best = f" (best of {s['repeats']})" if s.get("repeats", 1) > 1 else ""
    rows += [(f"prefill {s['prompt_len']} / chunk {s['chunk']}, in-order", f"{s['in_order_ms']:.0f} ms measured{best}, "
              f"{s['predicted_in_order_ms']:.0f} ms predicted"),
             ("  out-of-order", f"{s['ooo_ms']:.0f} ms measured, {s['predicted_ooo_ms']:.0f} ms predicted"),
             ("  out-of-order / in-order", f"{s['ooo_vs_in_order']:.2f} ({_spread(s)}this run; the ratio grows "
                                           "when other work shares the cores: bench/schedule.py measures it, best of "
                                           "3, and docs/benchmarks.md keeps its figures)"),
             ("  lanes busy (out-of-order)", ", ".join(f"{k} {v:.0f}%" for k, v in s["busy_pct_ooo"].items())),
             ("chunk-shared graphs save", f"{100 * s['chunk_shared_memory_saving']:.0f}% memory"),
             ("report / trace", f"{s['report']} / {s['trace']}")]
    if "seconds" in s:
        rows.append(("wall time", f"{s['seconds']:.0f} s"))
    return rows


def _spread(s: dict) -> str:
    """'each repeat 0.71–0.78, median 0.74; ' from the per-repeat ratios, '' for one repeat or an older summary."""
    r = s.get("ooo_vs_in_order_repeats") or []
    if len(r) < 2:
        return ""
    return f"each of {len(r)} repeats {min(r):.2f}–{max(r):.2f}, median {float(np.median(r)):.2f}; "


def summary_lines(s: dict) -> list[str]:
    rows = summary_rows(s)
    w = max(len(a) for a, _ in rows)
    return ["", "edgeprobe demo — summary", "-" * (w + 40)] + [f"{a:<{w}}  {b}" for a, b in rows]


def write_report(path: Path, m, outl, spar, acc, predicted, measured, summary) -> Path:
    """One self-contained HTML file: plotly.js inlined once, every figure a div, tables in HTML."""
    figs = [("Outlier channels per layer (mllm-NPU Fig. 10)", outl.figure("channels")),
            ("Share of outliers by channel (Fig. 11)", outl.figure("share")),
            ("FFN neurons inactive per layer (LLM in a flash)", spar.figure("inactive")),
            ("Predicted timeline: in-order", predicted["in-order"].to_trace().figure("predicted: in-order")),
            ("Predicted timeline: out-of-order", predicted["ooo"].to_trace().figure("predicted: out-of-order")),
            ("Measured timeline on the agent: in-order", measured["in-order"].trace.figure("measured: in-order")),
            ("Measured timeline on the agent: out-of-order", measured["ooo"].trace.figure("measured: out-of-order")),
            ("Measured against predicted (out-of-order)",
             measured["ooo"].trace.compare(measured["ooo"].schedule.to_trace())[0])]
    parts = []
    for i, (title, fig) in enumerate(figs):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0), default_height="520px"))
    def acc_row(r):
        d = r["delta_vs_float_pct"]
        return (f"<tr><td>{html.escape(r['scheme'])}</td><td>{r['perplexity']:.3f}</td>"
                f"<td>{'' if d is None else f'{d:+.2f}%'}</td><td>{100 * r['top1_agreement']:.2f}%</td>"
                f"<td>{r['weight_bytes'] / 1e6:.1f}</td></tr>")

    acc_rows = "".join(acc_row(r) for r in acc)
    summ = "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td></tr>" for a, b in summary_rows(summary))
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>edgeprobe report — {html.escape(m.name)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}
td:first-child{{text-align:left}}h2{{margin-top:2em}}</style></head><body>
<h1>edgeprobe report: {html.escape(m.name)}</h1>
<p>Real model, bundled corpus, local device agent (its <code>npu</code> lane is emulated on this CPU; every such event
says so). Timelines: {summary['prompt_len']}-token prompt, {summary['chunk']}-token chunks, w8a8-shadow.</p>
<h2>Summary</h2><table>{summ}</table>
<h2>Accuracy (held-out windows of 256 tokens)</h2>
<table><tr><th>scheme</th><th>perplexity</th><th>vs float</th><th>top-1 agreement</th><th>linear weights MB</th></tr>
{acc_rows}</table>
{''.join(parts)}
</body></html>"""
    path.write_text(doc)
    return path
