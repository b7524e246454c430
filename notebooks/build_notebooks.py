"""Writes the notebooks (unexecuted) from this one file, so their text can be reviewed as code:
    .venv/bin/python notebooks/build_notebooks.py"""
import nbformat as nbf
from nbformat.v4 import new_notebook, new_markdown_cell as md, new_code_cell as code

KERNEL = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
          "language_info": {"name": "python"}}


def results(name: str, body: str):
    """A last cell that writes the notebook's headline numbers as JSON to $EDGEPROBE_NB_RESULTS (default out/):
    the test suite bounds them, and two runs can be compared without reading the text."""
    return code(f"""# the headline numbers as data (tests/test_notebooks.py checks them)
import json, pathlib
RESULTS_DIR = pathlib.Path(os.environ.get("EDGEPROBE_NB_RESULTS", "out"))
RESULTS_DIR.mkdir(parents=True, exist_ok=True)
{body}
(RESULTS_DIR / "{name}.json").write_text(json.dumps(results, indent=1, default=float))
print(f"headline numbers written to {{RESULTS_DIR / '{name}.json'}}: {{', '.join(results)}}")""")

nb1 = new_notebook(metadata=KERNEL, cells=[
md("""# 01 · Where are SmolLM2's activation outliers?

**Question.** If SmolLM2-135M ran per-tensor W8A8 on a phone NPU, which activation values would fall
outside the int8 range, in how many channels, and which layers would actually need the float "shadow"
execution that mllm-NPU (§3.3) runs on the CPU?

mllm-NPU reports on Qwen1.5-1.8B / LLaMA-2-7B: outliers touch only **0.1–0.3 % of channels** per layer
(about 5–15; Fig. 10); **fewer than 3 % of channels produce over 80 %** of the outliers (Fig. 11); and the
outliers of the **85 % least important layers** can be pruned, importance being max outlier / scale, with
layers near the input and output mattering most (Fig. 12).

**Rule used here.** Each linear input (attn_in, attn_out, ffn_in, ffn_act) gets a per-tensor clip value
c = the 99.99th percentile of |x| on calibration tokens (int8 scale s = c/127); |x| > c is an outlier.
LLM.int8()'s fixed threshold 6.0 is kept as a second view. One inference = one 512-token window."""),
code("""import os
from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.profile.jobs import profile_outliers

MODEL = os.environ.get("EDGEPROBE_NB_MODEL", "smollm2-135m")  # or "gemma3-270m", or a GGUF path
TOKENS = int(os.environ.get("EDGEPROBE_NB_TOKENS", 32768))   # the test suite runs this notebook small
WINDOW = min(512, TOKENS // 4)
model = models.load(MODEL)
ids = model.tokenizer.encode(read_corpus("train"))
stats = profile_outliers(model, ids, tokens=TOKENS, window=WINDOW)
s = stats.summary()
print(f"{s['tokens']:,} tokens in {s['windows']} windows of {WINDOW}; "
      f"{100 * s['outlier_fraction_of_values']:.4f}% of all activation values are outliers")"""),
md("## Fig. 10 — outlier channels per layer"),
code("""stats.figure("channels")"""),
code("""print(f"ours : {s['fig10_outlier_channels_per_window_mean']:.1f} channels per window on average "
      f"= {s['fig10_outlier_channels_pct_mean']:.2f}% of channels (worst layer {s['fig10_outlier_channels_pct_max_layer']:.2f}%); "
      f"{s['fig10_outlier_channels_per_token_mean']:.3f} per token")
print("paper: 5-15 channels, 0.1-0.3% of channels (Qwen1.5-1.8B, 2048-token inference)")"""),
md("## Fig. 11 — a few channels produce most outliers"),
code("""stats.figure("share")"""),
code("""print(f"ours : {s['fig11_pct_channels_for_80pct_outliers']:.2f}% of channels produce 80% of outliers "
      f"(LLM.int8() threshold 6.0: {s['fig11_pct_channels_for_80pct_outliers_llm_int8']:.2f}%)")
print(f"       hot channels for 80% coverage per tensor: {s['hot_channels']} = {s['hot_channels_pct']:.2f}% of all channels")
print("paper: < 3% of channels produce > 80% of outliers")"""),
md("## Fig. 12 — which layers' outliers matter"),
code("""stats.figure("importance")"""),
code("""print("kept layers (15% most important):", s["kept_layers"])
print("paper: layers near the input and the output are the most important")"""),
md("## Where |x| sits relative to the clip"),
code("""stats.figure("histogram")"""),
md("""## What we found

Measured on SmolLM2-135M with 32,768 tokens of the bundled corpus (rerun the cells for live numbers):

- **Fig. 10 — agrees in shape, not in size.** About 10 channels per layer carry an outlier in a 512-token
  inference, close to the paper's 5–15 channels; but SmolLM2's layers are narrow (576 / 1536 channels), so
  that is ≈1 % of channels rather than 0.1–0.3 %.
- **Fig. 11 — agrees, more skewed.** Under 1 % of channels produce 80 % of the outliers (paper: < 3 %); with
  LLM.int8()'s fixed threshold 6.0 the concentration is stronger still. Keeping only hot-channel weight rows
  resident is therefore even more attractive here.
- **Fig. 12 — agrees.** Importance (max |x| / clip) is highest at layers 1–2 (input side) and 28 (output
  side); SmolLM2 adds one very large outlier in a middle layer (11), a massive-activation layer that a
  purely positional rule would miss. The measured ranking, not position, must decide what is pruned.
- Stats are values: `stats.merge(other)`, `stats.save(path)`, `OutlierStats.load(path)`, and
  `stats.smoothquant_scales()` feeds the quantizers."""),
code("""from edgeprobe.profile import OutlierStats
stats.save("out/notebook_outliers.npz")
assert OutlierStats.load("out/notebook_outliers.npz") == stats"""),
results("01_outliers", """present = [n for n in stats.names if n in stats.arrays]
results = {"model": MODEL, "layers": model.config.n_layers, "tokens": s["tokens"], "windows": s["windows"],
           "window": WINDOW, "percentile": s["percentile"],
           "channels": sum(len(stats.arrays[n]["chmax"]) for n in present),
           "outlier_values": sum(int(stats.arrays[n]["count"].sum()) for n in present),
           "outlier_fraction_of_values": s["outlier_fraction_of_values"],
           "outlier_channels_per_window_mean": s["fig10_outlier_channels_per_window_mean"],
           "outlier_channels_pct_mean": s["fig10_outlier_channels_pct_mean"],
           "outlier_channels_pct_max_layer": s["fig10_outlier_channels_pct_max_layer"],
           "pct_channels_for_80pct_outliers": s["fig11_pct_channels_for_80pct_outliers"],
           "pct_channels_for_80pct_outliers_llm_int8": s["fig11_pct_channels_for_80pct_outliers_llm_int8"],
           "hot_channels_pct": s["hot_channels_pct"], "layer_importance": stats.layer_importance().tolist(),
           "kept_layers": s["kept_layers"], "profile": str(pathlib.Path("out/notebook_outliers.npz").resolve())}"""),
])

nb2 = new_notebook(metadata=KERNEL, cells=[
md("""# 02 · How do a real MoE's tokens move through its experts?

**Question.** EdgeMoE keeps the experts of an MoE model on flash and loads only the routed ones. That pays
only if routing has structure: which experts does a token use, how predictable is the next layer's
choice from the previous ones, how few bits can each expert live with, and which buffer policy keeps the
right experts in memory?

EdgeMoE (docs/papers.md §3) measured on Switch Transformers: experts are used about evenly one by one, but
**the top 20 % of activation paths cover over 99 % of tokens** (Fig. 4, a power law); the next layer's expert is
predictable from the previous two — **P(E_n | E_n-1, E_n-2) reaches about 87 %** (Fig. 8); experts differ in how
much INT2 hurts (Fig. 7a), so the least sensitive can go to INT2 within a tolerated loss P (Fig. 15); and its
frequency-and-distance eviction policy beats FIFO/LRU/LFU at small buffers (Fig. 13).

**Model.** `tiny-moe` — edgeprobe's own Mixtral-layout MoE (6 layers, 8 experts, top-2, hidden 256), trained
on the bundled corpus by `datasets/moe/train_tiny_moe.py`; nothing is downloaded. A path is a token's top-1
expert at every layer."""),
code("""import json, os
import numpy as np
from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.profile.experts import CoActivationStats, record_routing
from edgeprobe.profile.runner import run

TOKENS = int(os.environ.get("EDGEPROBE_NB_TOKENS", 32768))   # the test suite runs this notebook small
WINDOW = min(256, int(os.environ.get("EDGEPROBE_NB_WINDOW", 256)))
WINDOWS = int(os.environ.get("EDGEPROBE_NB_WINDOWS", 4))
model = models.load("tiny-moe")
train = model.tokenizer.encode(read_corpus("train"))
heldout = model.tokenizer.encode(read_corpus("heldout"))
metrics = json.loads((models.resolve("tiny-moe") / "metrics.json").read_text())
print(model)
print(f"held-out loss {metrics['heldout']['loss']:.3f} nats (perplexity {metrics['heldout']['perplexity']:.1f}) "
      f"after {metrics['training']['steps']} steps, {metrics['training']['seconds'] / 60:.1f} min on {metrics['training']['threads']} CPU threads")
stats = run(model, train, CoActivationStats.for_model(model), window=WINDOW, max_tokens=TOKENS, desc="co-activation")
held = record_routing(model, heldout, WINDOW, max(WINDOW, TOKENS // 4))
s = stats.summary(held)
print(f"{stats.tokens:,} profiled tokens, {held.tokens:,} held-out tokens replayed")"""),
md("## Expert load: even one by one?"),
code("""stats.figure("frequency")"""),
code("""lb = stats.load_balance()
print("ours : max/mean load per layer", np.round(lb["max_over_mean"], 2), "(1 = even);",
      "load entropy", np.round(lb["load_entropy_bits"], 2), "bits of 3")
print("       router entropy per token", np.round(lb["router_entropy_bits"], 2), "bits")
print("paper: experts are activated about evenly (EdgeMoE §2.2), which is why caching by popularity alone fails")"""),
md("## Fig. 4 — activation paths follow a power law"),
code("""stats.figure("paths")"""),
code("""pl = s["path_power_law"]
print(f"ours : {pl['paths_observed']:,} distinct paths of {pl['paths_possible']:,} possible; top 20% of paths cover "
      f"{100 * s['top20pct_paths_token_share']:.1f}% of tokens; tokens ∝ rank^-{pl['alpha']:.2f} (R² {pl['r2']:.2f})")
print("paper: top 20% of paths cover > 99% of tokens (Switch Transformers)")"""),
md("## Fig. 8 — consecutive layers' experts are correlated"),
code("""stats.figure("conditional")"""),
code("""print("ours : mean peak P(E_n | E_n-1)       per layer", s["conditional_peak_order1"])
print("       mean peak P(E_n | E_n-1, E_n-2) per layer", s["conditional_peak_order2"])
print("paper: P(E_n | E_n-1, E_n-2) up to about 87% (top-1 routing, so one expert per layer)")"""),
md("""## The preload predictor on held-out tokens

While layer n-1 computes, preload the n experts the table ranks highest for layer n. Hit rate = share of the
experts layer n really uses that were preloaded."""),
code("""stats.figure("predictor", heldout=held)"""),
code("""hr = s["predictor_hit_rate"]
for order in ("order0", "order1", "order2"):
    print(f"ours : {order}: " + ", ".join(f"top-{n} {100 * hr[order][f'top{n}']:.1f}%" for n in (1, 2, 3, 4)))
print("paper: preloading the predicted experts hides most expert I/O behind compute (Fig. 16)")"""),
md("""## Fig. 7a — which experts tolerate INT2?

Each expert alone at per-channel INT2 (ternary), all other experts at INT4, attention at INT8: the change in
loss on calibration windows of the *training* split (the held-out text stays for evaluation)."""),
code("""from edgeprobe.quant import ExpertBitsStudy
study = ExpertBitsStudy(model, train, window=WINDOW, max_windows=WINDOWS)
study.measure_sensitivity()
study.figure("sensitivity")"""),
code("""sens = study.sensitivity
print(f"ours : INT2 on one expert costs {1000 * sens.min():.2f} to {1000 * sens.max():.2f} mnats "
      f"(median {1000 * np.median(sens):.2f}); the most sensitive expert costs {sens.max() / max(np.median(sens), 1e-9):.1f}x the median")
print(f"       all experts INT2 / INT4 / INT8: {100 * np.expm1(study.uniform[2] - study.float_loss):+.1f}% / "
      f"{100 * np.expm1(study.uniform[4] - study.float_loss):+.2f}% / {100 * np.expm1(study.uniform[8] - study.float_loss):+.2f}% perplexity")
print("paper: INT2 on single experts costs 0.44% to over 1% Rouge-2 and differs between experts (ST-base-8)")"""),
md("## Fig. 15 — model bytes against loss as the tolerated loss P varies"),
code("""sels = study.curve((0.01, 0.02, 0.05, 0.1, 0.2, 0.5))
for x in sels:
    print(f"P = {100 * x.tolerance:4.0f}%: {x.k_low:2d} experts at INT{x.low}, rest INT{x.high}: "
          f"{x.model_bytes / 1e6:.2f} MB, perplexity +{100 * x.perplexity_increase:.2f}%")
print("paper: model size and latency fall as P grows from 5% to 20% (ST-base-8/16, Fig. 15)")
study.figure("tolerance", sels)"""),
md("## moe-mixed in the quantization table (held-out text)"),
code("""from edgeprobe.quant.report import accuracy_table, format_table
sel = next(x for x in sels if x.tolerance == 0.05)
rows = accuracy_table(model, heldout, None, ["float", "llm-int8", "q4_0", "moe-mixed"], window=WINDOW,
                      max_windows=WINDOWS, expert_bits=sel.bits)
print(format_table(rows))
print("paper: EdgeMoE's accuracy loss lands close to the tolerated 5%")"""),
md("## Fig. 13 — expert buffer policies, with and without preloading"),
code("""from edgeprobe.profile.expert_cache import sweep
from edgeprobe.profile.expert_figures import cache_figure
from edgeprobe.quant.expert_bits import expert_nbytes
eb = expert_nbytes(model.config, 4)
caps = [4, 8, 12, 16, 24, 32]
cache_rows = sweep(held, caps, stats.a["freq"], stats.predictor(2), expert_bytes=eb)
cache_figure(cache_rows, eb, f"{held.tokens:,} held-out tokens, INT4 experts of {eb / 1e3:.0f} kB")"""),
code("""for c in caps:
    r = {(x["policy"], x["preload"]): x for x in cache_rows if x["capacity"] == c}
    print(f"buffer {c:2d} experts: " + ", ".join(f"{p} {100 * r[(p, False)]['hit_rate']:.0f}%/{100 * r[(p, True)]['hit_rate']:.0f}%"
                                              for p in ("fifo", "lru", "lfu", "edgemoe")) + "  (no preload / preload)")
print("paper: EdgeMoE's policy has the highest hit rate at every buffer size (Fig. 13)")"""),
md("""## What we found

Measured on `tiny-moe` with 32,768 training-split tokens profiled and 8,192 held-out tokens replayed (rerun the
cells for live numbers):

- **Load is even, routing is decided.** Per-layer load entropy is 2.72–2.98 bits of 3 (max/mean load 1.2–1.9;
  the first layer is the least even) while each token's router entropy is only 0.6–1.1 bits: every expert
  is busy, yet each token knows where it goes — EdgeMoE's premise.
- **Fig. 4 — a power law, with a fatter tail.** 2,817 distinct top-1 paths of 262,144 possible; tokens per path
  fall as rank^-1.16 (R² 0.98), and the top 20% of paths cover **86% of tokens**, not the paper's >99%: a 6-layer
  model trained on 250k tokens has less path redundancy than Switch Transformers on real text.
- **Fig. 8 — strong layer-to-layer correlation.** The best next expert given the previous two layers'
  top-1 experts has probability **77–85%** on average per layer (paper: up to about 87%); given one layer only,
  62–76%.
- **Preloading works.** On held-out tokens, preloading the table's top-2 experts catches **61% of the experts
  actually used** (order-1 table 56%, frequency alone 30%, random 25%); top-4 catches 86%.
- **Fig. 7a — experts differ.** One expert at INT2 costs from nothing to 0.34 nats (median 0.015): a handful of
  experts (busy ones in the first layer) matter far more than the rest. All experts at INT2 is catastrophic
  (ternary per-channel weights: perplexity ×6), INT4 costs +0.7%.
- **Fig. 15 — the tolerance buys bytes.** P = 1% puts 5 experts at INT2, P = 5% 12, P = 50% 32, shrinking the
  model from 9.99 to 8.67 MB; on the held-out text moe-mixed at P = 5% costs **+4.4%** perplexity (paper: loss
  lands close to the tolerated 5%). Widths are chosen on training-split windows, where this small model
  fits better than on held-out text.
- **Fig. 13 — EdgeMoE's policy wins most, not all, buffer sizes.** Without preloading it has the best hit rate at
  every size except 12 experts (LRU 34% vs 29%), and it is the only policy that hits at all below L·k = 12 experts
  (FIFO/LRU thrash). Preloading lifts every policy (e.g. 16 experts: 40% → 66%) but reads mispredicted experts
  too, so bytes per token rise; LFU is worst throughout, since nearly even load makes counts uninformative."""),
results("02_experts", """np.save(RESULTS_DIR / "02_experts_routing.npy", np.asarray(held.experts))  # the replayed routing
results = {"tokens": stats.tokens, "heldout_tokens": held.tokens, "experts": model.config.n_experts,
           "layers": model.config.n_layers, "top_k": model.config.n_experts_used,
           "load_entropy_bits": lb["load_entropy_bits"].tolist(), "router_entropy_bits": lb["router_entropy_bits"].tolist(),
           "load_max_over_mean": lb["max_over_mean"].tolist(),
           "paths_observed": pl["paths_observed"], "paths_possible": pl["paths_possible"],
           "top20pct_paths_token_share": s["top20pct_paths_token_share"],
           "conditional_peak_order1": s["conditional_peak_order1"], "conditional_peak_order2": s["conditional_peak_order2"],
           "predictor_hit_rate": hr, "float_loss": study.float_loss,
           "uniform_loss": {f"int{b}": v for b, v in study.uniform.items()}, "sensitivity": sens.tolist(),
           "other_bytes": study.other_nbytes(),
           "tolerance_curve": [{k: v for k, v in x.to_dict().items() if k != "experts_by_bits"} for x in sels],
           "accuracy": {r["scheme"]: r["perplexity"] for r in rows},
           "cache": [{k: r[k] for k in ("policy", "capacity", "preload", "hit_rate")} for r in cache_rows],
           "routing": str((RESULTS_DIR / "02_experts_routing.npy").resolve())}"""),
])

nb5 = new_notebook(metadata=KERNEL, cells=[
md("""# 05 · Where does the time go when SmolLM2's prefill runs on the device?

**Question.** mllm-NPU runs int8 linears on the phone's NPU and the float work — attention, norms, the
shadow-outlier GEMMs — on the CPU, overlapping the two (§3.3); HeteroLLM gives W4A16 matmuls to the GPU.
On a real agent process, with real lanes: how busy is each processor, where are the bubbles, and does the
device compute what the host simulates?

**Honest setup.** The agent here runs on this machine: the `npu` lane executes the NPU-semantics int8
kernels on the CPU (every event is marked *emulated*), the `gpu` lane runs OpenCL kernels on PoCL (a CPU
OpenCL driver), and both share two cores. The *shape* of the timeline — what waits for what — is real; the
*speeds* are not a phone's. `edgeprobe run --device ssh://...` gives the same picture from a real phone."""),
code("""import os
import numpy as np
from edgeprobe import models, Device
from edgeprobe.corpus import read_corpus
from edgeprobe.forward import forward
from edgeprobe.quant import quantize, calibration_profile
from edgeprobe.trace import cosine

N = int(os.environ.get("EDGEPROBE_NB_PROMPT", 256))         # the test suite runs this notebook small
CALIB = int(os.environ.get("EDGEPROBE_NB_CALIB", 4096))
model = models.load("smollm2-135m")
prompt = model.tokenizer.encode(read_corpus("heldout"))[:N]
calib = calibration_profile(model, model.tokenizer.encode(read_corpus("train")), tokens=CALIB, window=min(512, CALIB))
qm = quantize(model, "w8a8-shadow", calib)
dev = Device.local()
print({k: dev.info[k] for k in ("agent_version", "lanes", "emulated_lanes", "cores")}, "OpenCL:", dev.info["opencl"])
dev.prefill(qm, prompt)                       # first run: upload what the agent lacks, JIT, first reads from flash
res = dev.prefill(qm, prompt)                 # the run we look at
host = qm.forward(prompt, logits="last")
flt = forward(model, prompt, logits="last")     # what w8a8-shadow approximates
print(f"prefill {N} tokens: makespan {res.trace.metrics()['makespan_ms']:.0f} ms; "
      f"logits cosine vs the host's simulation {cosine(res.logits[0], host):.6f}, vs the float model {cosine(res.logits[0], flt):.4f}")"""),
md("## The timeline: int8 linears on the (emulated) NPU, float work on the CPU"),
code("""res.trace.figure(f"SmolLM2-135M w8a8-shadow prefill, {N} tokens, layer-by-layer plan")"""),
code("""m = res.trace.metrics()
for lane, v in m["lanes"].items():
    print(f"{lane:>4}: busy {v['busy_pct']:5.1f}%  ops {v['ops']:4d}  bubbles {v['bubbles']:4d} ({v['bubble_ms']:.0f} ms)"
          + ("  [emulated]" if v["emulated"] else ""))
print("paper (mllm-NPU §3.4): a naive in-order schedule leaves the NPU idle while the CPU works; "
      "out-of-order chunk scheduling (next issue) is what fills the bubbles")"""),
md("## Which ops take the time"),
code("""import plotly.express as px
df = res.trace.to_dataframe()
by = df.groupby(["lane", "kind"], as_index=False)["dur_ms"].sum().sort_values("dur_ms", ascending=False)
px.bar(by, x="kind", y="dur_ms", color="lane", title="Time per op kind and lane (ms, summed over ops)")"""),
code("""print(by.to_string(index=False))
print(f"outliers handled by the shadow GEMMs: {res.counters.get('outliers', 0)}; cold shadow rows read from flash: "
      f"{res.counters.get('cold_rows_read', 0)} ({res.counters.get('cold_bytes_read', 0) / 1e3:.0f} kB)")"""),
md("""## HeteroLLM's GPU side: W4A16 linears in OpenCL

The same prompt under `q4_0` (4-bit weights, FP16 activations), its linears on the `gpu` lane. PoCL has no
`cl_khr_fp16`: weights are stored as half and read with `vload_half4`, arithmetic is FP32."""),
code("""q4 = quantize(model, "q4_0")
dev.prefill(q4, prompt, float_lane="gpu")
gpu = dev.prefill(q4, prompt, float_lane="gpu")
print(f"cosine vs host: {cosine(gpu.logits[0], q4.forward(prompt, logits='last')):.6f}")
gpu.trace.figure(f"SmolLM2-135M q4_0 prefill, {N} tokens, linears on the gpu lane (OpenCL on PoCL)")"""),
md("""## Try it: chunk length, scheduler, prune rate and scheme

Each press of **Run on the agent** quantizes (cached per scheme and prune rate), sends only the blobs the agent
lacks, runs the prefill there and redraws the timeline in place. `layer` is the layer-by-layer plan above;
`in-order` and `ooo` cut the prompt into chunks (mllm-NPU §3.2) and order the subgraphs (§3.4). The prune rate
is the fraction of layers whose outliers w8a8-shadow drops (§3.3; the paper prunes 85%)."""),
code("""from edgeprobe.widgets import TimelineExplorer

explorer = TimelineExplorer(dev, model, prompt, calib)
explorer"""),
md("The same controls from code — a small sweep, each run on the agent; the panel above redraws with each."),
code("""import pandas as pd
opts = explorer.controls["chunk"].options
small = max([c for c in opts if c <= max(opts) // 4] or [min(opts)])  # four chunks, as 1024 / 256 in the paper
for settings in ({"scheduler": "in-order", "chunk": small}, {"scheduler": "ooo", "chunk": small},
                 {"scheduler": "ooo", "prune_rate": 0.0}, {"scheme": "q4_0-tile", "scheduler": "layer"}):
    explorer.set(**settings).run()
sweep = pd.DataFrame(explorer.history)
cols = [c for c in ("scheme", "prune_rate", "scheduler", "chunk", "makespan_ms", "predicted_makespan_ms",
                    "predicted_over_measured", "flash_read_mb", "npu_busy_pct", "cpu_busy_pct", "cosine_vs_host") if c in sweep]
print(sweep[cols].round(3).to_string(index=False))
print("the panel now shows:", explorer.figure.layout.title.text.split("<br>")[0], f"({sum(len(t.x) for t in explorer.figure.data)} bars)")
print("predicted_over_measured: the modelled cost model's makespan over the measured one (1.00 = exact); it prices int8 "
      "GEMMs, elementwise ops, per-op costs and the shadow GEMMs of the layers the prune rate keeps, not first reads "
      "from flash (flash_read_mb > 0: a cold run) nor two lanes slowing each other on shared cores")
print("paper (mllm-NPU §3.4): in-order overlap leaves 37% bubbles; out-of-order cuts prefill latency 18-44%")"""),
code("""px.bar(sweep.assign(setting=[f"{i + 1}: {TimelineExplorer.describe(r)}" for i, r in sweep.iterrows()]),
       x="setting", y="makespan_ms", title="Makespan of each explorer run (ms, measured on the agent)")"""),
code("""explorer.snapshot()  # the panel's last timeline as a plain figure: an exported page has no widget JavaScript"""),
md("""## The npu lane as Hexagon machine code: what it would cost on a DSP

The agent can run its `npu` lane on a second backend, `hvx`: the same kernels written in C with HVX intrinsics
(vrmpy int8 GEMM, vlut16 dequantization), built for Hexagon v67 and executed by `qemu-hexagon` (docs/hvx.md).
Results are real machine code's and bit-identical to the numba lane's; QEMU's time is not a DSP's, so each
event also carries the packets QEMU executed and an **estimate** for a v73 cDSP (one packet per cycle on one
thread, no stalls, 1 GHz assumed). 16 tokens: QEMU is slow. Below, per linear type, summed over the 30 layers:
the x86 lanes as measured, QEMU's time, and the DSP estimate."""),
code("""import tempfile
import pandas as pd
import plotly.express as px
from edgeprobe_kernels import hvx_bridge

short = prompt[:min(16, N // 4)]   # QEMU is slow: 16 tokens (8 when the test suite runs this notebook small)
if hvx_bridge.unavailable_reason():
    print("hvx backend unavailable here:", hvx_bridge.unavailable_reason())
else:
    with tempfile.TemporaryDirectory() as store, Device.local(store=store, npu_backend="hvx") as hdev:
        on_dsp = hdev.prefill(qm, short)  # a second agent needs its own store (flash)
    on_x86 = dev.prefill(qm, short)
    print("logits identical to the numba lane's:", np.array_equal(on_dsp.logits, on_x86.logits))
    rows = []
    for label, run in (("x86 (numba, measured)", on_x86), ("qemu-hexagon (emulated: isa)", on_dsp)):
        for e in run.trace.events:
            if e["lane"] == "npu":
                rows.append({"linear": e["name"].split(".")[2], "where": label, "ms": (e["end_us"] - e["start_us"]) / 1e3})
                if e.get("isa"):
                    rows.append({"linear": e["name"].split(".")[2], "where": "v73 cDSP (estimate)",
                                 "ms": e["dsp_us_estimate"] / 1e3})
    cost = pd.DataFrame(rows).groupby(["linear", "where"], as_index=False)["ms"].sum()
    print(cost.pivot(index="linear", columns="where", values="ms").round(2).to_string())
    packets = sum(e["hvx_packets"] for e in on_dsp.trace.events if e.get("isa"))
    print(f"{packets:,} HVX-program packets for {len(short)} tokens: ~{packets / 1e6:.0f} ms at 1 GHz on one DSP thread")
    display(px.bar(cost, x="linear", y="ms", color="where", barmode="group", log_y=True,
                   title=f"npu lane per linear type, {len(short)}-token w8a8-shadow prefill (ms, log scale)"))"""),
code("""path = res.trace.to_chrome_json("out/trace_w8a8_shadow.json")
print(f"wrote {path}: open it in https://ui.perfetto.dev or chrome://tracing (one track per lane, arrows for dependencies)")
dev.close()"""),
md("""## What we found

Measured with a 256-token prompt on this 2-core machine (rerun the cells for live numbers):

- **The device computes what the host simulates**: the agent's last-token logits match the host's simulation of
  `w8a8-shadow` with cosine 1.000000 — the same kernels run on both sides (`edgeprobe_kernels`); chunked runs
  match the host's unchunked pass to 0.999+ (attention over chunks sums in another order).
- **The emulated NPU lane is the bottleneck** of the layer-by-layer plan: busy 70–75% of a 0.9–1.2 s makespan,
  0.6–0.9 s of it in 210 int8 linears (exact int8 GEMMs by K-blocked float BLAS, one core), while the CPU lane is
  busy 29–35%; the plan serializes each layer's attention behind its Q/K/V projections. On a phone the NPU would be
  10–50× faster and the picture would flip — the CPU's float work would be the critical path, mllm-NPU's motivation
  for out-of-order scheduling.
- **Lanes really overlap**: the shadow-outlier GEMMs of Q/K/V (660 outliers, 61 cold rows = 164 kB read from
  flash) run on the CPU while the NPU lane runs the next projection; the bubbles per lane (209 on the NPU,
  ≈ 0.3 s in all) are the dependency waits a scheduler can fill.
- **The live panel** (four chunks of 64): out-of-order 990 ms against in-order 1272 ms (0.78×; the paper: 18–44%
  faster), NPU busy 84% → 94%. Keeping every layer's outliers (prune rate 0 instead of mllm-NPU's 0.85) costs
  1.66× (1644 ms): the shadow GEMMs are what the prune rate buys back. `q4_0-tile` layer by layer takes 4.5 s on
  the emulated NPU (tile dequantization per GEMM). The host's modelled profile under-predicts small chunks.
- **The GPU lane** (OpenCL on PoCL) runs W4A16 linears with half-stored weights; on this CPU OpenCL driver it
  is slower than the CPU lane's BLAS, which is expected: the lane exists to measure a phone's Adreno.
- **The npu lane as Hexagon code** (16 tokens, w8a8-shadow, measured once): logits identical to the numba lane's;
  the 210 int8 linears are 26 M packets of HVX-program code, an *estimated* 26 ms on one v73 DSP thread at an
  assumed 1 GHz, against 131 ms measured for the numba lane on one x86 core and 7.2 s under qemu-hexagon (QEMU's
  time means nothing for a phone; the packet count is the DSP-side number). FFN projections are 2/3 of it."""),
results("05_device_timeline", """lane_ms = df.groupby("lane")["dur_ms"].sum().to_dict()
results = {"prompt": N, "makespan_ms": m["makespan_ms"], "cosine_vs_host": cosine(res.logits[0], host),
           "cosine_vs_float": cosine(res.logits[0], flt),
           "lanes": {k: {**{f: v[f] for f in ("busy_pct", "ops", "bubbles", "bubble_ms", "emulated")},
                         "op_ms": lane_ms.get(k, 0.0)} for k, v in m["lanes"].items()},
           "counters": {k: res.counters.get(k, 0) for k in ("outliers", "cold_rows_read", "cold_bytes_read")},
           "shadow_layers": sum(1 for r in qm.manifest["linears"].values() if r.get("shadow")) // 7,
           "gpu_cosine_vs_host": cosine(gpu.logits[0], q4.forward(prompt, logits="last")),
           "gpu_lane_ops": gpu.trace.metrics()["lanes"]["gpu"]["ops"],
           "sweep": sweep[cols].to_dict("records")}"""),
])

nb6 = new_notebook(metadata=KERNEL, cells=[
md("""# 06 · How should a chunked prefill be cut and ordered across processors?

**Question.** mllm-NPU cuts a prompt into fixed chunks so that the NPU's static graphs can be *shared* by all
chunks (§3.2), then runs subgraphs out of order to fill the bubbles between NPU and CPU (§3.4). HeteroLLM
instead partitions each matmul between GPU and NPU (§4). How much do these choices buy — predicted on a
modelled phone, and measured on our agent?

Paper numbers: chunk-shared graphs save **up to 75%** memory (Qwen1.5-1.8B, prompt 1024, chunk 256; 120 of 144
subgraphs shared); in-order overlap leaves **37% bubbles**, out-of-order execution cuts prefill latency
**18–44%**; HeteroLLM's solver beats padding by **up to 2.12×** at unaligned lengths and the multi-shape "pipe" by
**13–30%**. Every modelled number below says *modelled*; the Snapdragon profile is calibrated to mllm-NPU's own
measurement (Qwen1.5-1.8B, 256 tokens: NPU 315 ms, CPU about half)."""),
code("""import os
import dataclasses
import numpy as np
import plotly.graph_objects as go
from edgeprobe import models
from edgeprobe.models import ModelConfig
from edgeprobe.schedule import chunk_graph, schedule, device_profile
from edgeprobe.schedule.hetero import compare_strategies

PROMPT = int(os.environ.get("EDGEPROBE_NB_PROMPT", 1024))   # the test suite runs the agent part small
QWEN = ModelConfig(arch="llama", n_layers=24, hidden=2048, ffn=5504, n_heads=16, n_kv_heads=16, head_dim=128,
                   vocab_size=151936, context_length=32768, tie_embeddings=False, name="Qwen1.5-1.8B")
smollm = models.load("smollm2-135m")
sd = device_profile("snapdragon-8gen3")
print(sd.source)"""),
md("## §3.2 — chunk-shared graphs: memory"),
code("""mem_rows = []
for name, cfg in (("Qwen1.5-1.8B", QWEN), ("SmolLM2-135M", smollm.config)):
    m = chunk_graph(cfg, 1024, 256).memory()
    mem_rows.append((name, m))
    print(f"ours ({name}, 1024 / 256): per-chunk graphs {m['chunk_graphs_bytes'] / 1e6:,.0f} MB, chunk-shared "
          f"{m['chunk_shared_bytes'] / 1e6:,.0f} MB: {100 * m['saving']:.0f}% saved; {m['shared_subgraphs']} of "
          f"{m['subgraphs_per_chunk']} subgraphs per chunk shared")
print("paper: up to 75% saved (Qwen1.5-1.8B), 120 of 144 subgraphs shared")
go.Figure([go.Bar(x=[n for n, _ in mem_rows], y=[m["chunk_graphs_bytes"] / 1e6 for _, m in mem_rows], name="a graph per chunk"),
           go.Bar(x=[n for n, _ in mem_rows], y=[m["chunk_shared_bytes"] / 1e6 for _, m in mem_rows], name="chunk-shared graphs")]
          ).update_layout(title="Pre-built graph memory at prompt 1024, chunk 256 (weights + buffers, modelled)",
                          yaxis_title="MB", barmode="group")"""),
md("## §3.4 — in-order against out-of-order (modelled Snapdragon 8 Gen 3, Qwen1.5-1.8B)"),
code("""g = chunk_graph(QWEN, 1024, 256)
ino, ooo = schedule(g, sd, "in-order"), schedule(g, sd, "ooo")
print(f"ours (modelled): in-order {ino.makespan_us / 1e3:.0f} ms, out-of-order {ooo.makespan_us / 1e3:.0f} ms = "
      f"{ooo.makespan_us / ino.makespan_us:.2f}x; NPU busy {ino.busy()['npu']:.0f}% -> {ooo.busy()['npu']:.0f}%; "
      f"{ooo.decision_us:.1f} µs per decision")
print("paper: out-of-order cuts prefill latency 18-44% (0.56-0.82x); decisions take microseconds")
ooo.to_trace().figure("out-of-order schedule, Qwen1.5-1.8B 1024 / 256 (modelled)")"""),
code("""ino.to_trace().figure("in-order schedule, Qwen1.5-1.8B 1024 / 256 (modelled)")"""),
md("### How far is the heuristic from the optimum? (small instances, exact branch and bound)"),
code("""gaps = []
for prompt in (256, 512, 768):
    gs = chunk_graph(dataclasses.replace(QWEN, n_layers=1), prompt, 256)
    opt = schedule(gs, sd, "exact")
    h = schedule(gs, sd, "ooo")
    gaps.append((prompt, len(gs.subgraphs), h.makespan_us / opt.makespan_us - 1))
    print(f"1 layer, prompt {prompt}: {len(gs.subgraphs)} subgraphs, ooo {h.makespan_us / 1e3:.2f} ms vs optimum "
          f"{opt.makespan_us / 1e3:.2f} ms: gap {100 * gaps[-1][2]:.1f}%")
print("paper: the heuristic is not compared to an optimum (the problem is NP-hard); ours is, on small instances")"""),
md("## §4 — HeteroLLM's partition solver at unaligned prompt lengths (modelled)"),
code("""res = {m: compare_strategies(QWEN, m) for m in (256, 300, 525, 1000)}
strategies = ["gpu", "npu-pad", "pipe", "seq-cut", "row-cut", "solver"]
fig = go.Figure([go.Bar(x=[str(m) for m in res], y=[res[m]["total_ms"][s] for m in res], name=s) for s in strategies])
fig.update_layout(title="Prefill matmul time of Qwen1.5-1.8B by partition strategy (modelled Snapdragon 8 Gen 3)",
                  xaxis_title="prompt length", yaxis_title="ms (all layers' linears)", barmode="group")
for m, r in res.items():
    print(f"ours {m:5d} tokens: solver {r['total_ms']['solver']:.0f} ms; vs padding {r['speedup_vs_padding']:.2f}x, "
          f"vs pipe {r['speedup_vs_pipe']:.2f}x; per matmul: " + ", ".join(sorted({c['strategy'] for c in r['choices'].values()})))
print("paper: up to 2.12x over padding at unaligned lengths; 13-30% over pipe")
fig"""),
md("""## Measured on the agent: a cost model first (HeteroLLM's profiler), then in-order against out-of-order

The schedulers decide by predicted times, so they are only as good as the cost model. We measure it on the agent:
in-order chunked prefills over a grid of chunk lengths give every subgraph's busy time; HeteroLLM's *real* mode
looks those up, its *predicted* mode fits `t = a + b·FLOPs` per lane and stage (any shape)."""),
code("""from edgeprobe import Device
from edgeprobe.corpus import read_corpus
from edgeprobe.quant import quantize, calibration_profile
CALIB = int(os.environ.get("EDGEPROBE_NB_CALIB", 4096))
CHUNK = max(16, PROMPT // 4)
qm = quantize(smollm, "w8a8-shadow", calibration_profile(smollm, smollm.tokenizer.encode(read_corpus("train")),
                                                         tokens=CALIB, window=min(512, CALIB)))
ids = smollm.tokenizer.encode(read_corpus("heldout"))
toks = ids[:PROMPT]
dev = Device.local()
prof = dev.measure_profile(qm, ids, chunks=(CHUNK // 4, CHUNK // 2, CHUNK), n_chunks=3)
err = prof.fit_error()
print(prof.source)
print("predicted-mode error on chunk lengths left out of the fit: "
      + ", ".join(f"{k} {100 * v['median']:.0f}%" for k, v in err.items() if k != "all"))
lanes = sorted(prof.fits)
fig = go.Figure()
for key in lanes:
    pts = [s for s in prof.samples if f"{s['lane']}/{s['stage']}" == key]
    fig.add_scatter(x=[s["flops"] / 1e6 for s in pts], y=[s["us"] / 1e3 for s in pts], mode="markers", name=f"{key} measured")
    a, b = prof.fits[key]
    xs = np.linspace(0, max(s["flops"] for s in pts), 20)
    fig.add_scatter(x=xs / 1e6, y=(a + b * xs) / 1e3, mode="lines", name=f"{key} fit")
fig.update_layout(title="Subgraph time against FLOPs on the agent (npu lane emulated), with the fitted model",
                  xaxis_title="MFLOP", yaxis_title="ms")"""),
code("""dev.prefill_chunked(qm, toks, chunk=CHUNK, scheduler="in-order", profile=prof)     # warm
measured = {s: dev.prefill_chunked(qm, toks, chunk=CHUNK, scheduler=s, profile=prof) for s in ("in-order", "ooo")}
mk = {s: r.trace.metrics() for s, r in measured.items()}
print(f"ours (measured, {PROMPT} / {CHUNK}): in-order {mk['in-order']['makespan_ms']:.0f} ms, out-of-order "
      f"{mk['ooo']['makespan_ms']:.0f} ms = {mk['ooo']['makespan_ms'] / mk['in-order']['makespan_ms']:.2f}x; "
      f"npu busy {mk['in-order']['lanes']['npu']['busy_pct']:.0f}% -> {mk['ooo']['lanes']['npu']['busy_pct']:.0f}%")
print("paper: 0.56-0.82x; goal here <= 0.85x at 1024 tokens (bench/schedule.py measures it side by side)")
measured["ooo"].trace.figure("measured: out-of-order chunked prefill on the local agent")"""),
code("""fig, rows = measured["ooo"].trace.compare(measured["ooo"].schedule.to_trace(), "measured vs predicted (fitted profile)")
err = np.array([r["error"] for r in rows])
print(f"{len(rows)} subgraphs: median per-subgraph prediction error {100 * np.median(np.abs(err)):.0f}%; makespan "
      f"predicted {measured['ooo'].schedule.makespan_us / 1e3:.0f} ms, measured {mk['ooo']['makespan_ms']:.0f} ms")
fig"""),
md("""## Measured on the agent: HeteroLLM's partitions on the gpu (OpenCL) and npu (emulated) lanes

The solver needs each lane's GEMM rate, the hand-off cost, and — new here — how much each lane slows while the
other runs (on a phone the GPU and NPU share memory bandwidth; on this host they also share the two cores)."""),
code("""hp, _ = dev.measure_linears(qm, rows=(32, 64, 128, 256) if PROMPT < 256 else (32, 64, 128, 256, 512, 1024))
print(f"npu {hp.npu_gops:.0f} GOP/s, gpu {hp.gpu_gflops:.0f} GFLOP/s, hand-off {hp.sync_us:.0f} µs; slowdown when both "
      f"run: npu x{hp.slowdown_npu:.2f}, gpu x{hp.slowdown_gpu:.2f}")
N = 300 if PROMPT >= 300 else 45                                # unaligned
pred = compare_strategies(smollm.config, N, hp)
dev.prefill_hetero(qm, ids[:N], hp, "solver")                   # warm this length's shapes
meas = {s: dev.prefill_hetero(qm, ids[:N], hp, s).trace.metrics()["makespan_ms"]
        for s in ("solver", "npu-pad", "pipe", "gpu", "seq-cut", "row-cut")}
dev.close()
print(f"{N} tokens: solver picks " + ", ".join(sorted({c['strategy'] for c in pred['choices'].values()})))
print(f"measured: solver vs padding {meas['npu-pad'] / meas['solver']:.2f}x (predicted {pred['speedup_vs_padding']:.2f}x), "
      f"vs pipe {meas['pipe'] / meas['solver']:.2f}x (predicted {pred['speedup_vs_pipe']:.2f}x)")
go.Figure(go.Bar(x=list(meas), y=list(meas.values()))).update_layout(
    title=f"Measured prefill of {N} tokens on the agent by partition strategy", yaxis_title="ms")"""),
md("""## What we found

Measured and modelled (rerun the cells for live numbers; `make bench` runs bench/schedule.py):

- **Chunk-shared graphs save 64% of pre-built graph memory** for Qwen1.5-1.8B at 1024 / 256 (paper: up to 75%),
  48% for SmolLM2 (its attention buffers weigh more against its small weights); 3 of 4 subgraphs per layer are
  shared, as in the paper (120 of 144).
- **Out-of-order execution** on the modelled Snapdragon: 0.61× the in-order makespan for Qwen1.5-1.8B at
  1024 / 256 — inside the paper's 0.56–0.82×; about 1 µs per decision in Python. Against the exact optimum on
  small instances (one layer, 4 / 8 / 12 subgraphs) the heuristic's gap is 0% / 0% / 1.1%.
- **Measured on our agent** (SmolLM2 w8a8-shadow, 1024 / 256, bench/schedule.py, three alternating runs each):
  out-of-order over the measured profile **0.69–0.75× in-order** over two bench runs (best of 3; medians
  0.66–0.76×): the NPU lane's idle time falls from ≈1.2 s to 0.1–0.45 s (busy 73–75% → 87–96%). Two things got it there: an exact int8 GEMM 3–4× faster (the
  emulated NPU had carried 90% of the makespan, leaving nothing to overlap) and deciding by measured costs.
- **The fitted cost model** predicts held-out chunk lengths within 14–25% median error per stage, and the
  whole makespan within about 10%.
- **HeteroLLM's solver**, modelled Snapdragon: beats padding 1.88× / 1.94× / 1.47× at 300 / 525 / 1000 tokens
  (paper: up to 2.12×) and the pipe 1.23× / 1.05× / 1.52× (paper: 13–30%). **Measured on the agent** the lanes
  slow each other (npu ×2.3, gpu ×1.2 while both run: PoCL's "GPU" is the same two cores), so cutting a matmul
  rarely pays; with the slowdowns in its model the solver keeps each matmul whole on the NPU (pipe at 300 / 525,
  padding at 1000 — the same plans as those baselines) and beats padding 1.18–1.31× / 1.48–1.62× / 1.00–1.07×
  over two bench runs; forced row cuts measure 1.1–1.5× slower than its choice. A phone's separate GPU and
  NPU are where the paper's split gains live; the solver here is the same code with measured inputs."""),
results("06_scheduling", """results = {
    "memory_1024_256": {name: {k: m_[k] for k in ("saving", "shared_subgraphs", "subgraphs_per_chunk", "chunk_graphs_bytes",
                                                  "chunk_shared_bytes")} for name, m_ in mem_rows},
    "modelled": {"in_order_ms": ino.makespan_us / 1e3, "ooo_ms": ooo.makespan_us / 1e3,
                 "npu_busy_in_order": ino.busy()["npu"], "npu_busy_ooo": ooo.busy()["npu"], "decision_us": ooo.decision_us},
    "exact_gap": [{"prompt": p_, "subgraphs": n_, "gap": g_} for p_, n_, g_ in gaps],
    "hetero_modelled": {str(m_): {"total_ms": r_["total_ms"], "speedup_vs_padding": r_["speedup_vs_padding"],
                                  "speedup_vs_pipe": r_["speedup_vs_pipe"]} for m_, r_ in res.items()},
    "fit_error_median": {k: v["median"] for k, v in prof.fit_error().items() if k != "all"},
    "measured": {"prompt": PROMPT, "chunk": CHUNK,
                 **{s_: {"makespan_ms": mk[s_]["makespan_ms"], "lanes": {k: v["busy_pct"] for k, v in mk[s_]["lanes"].items()},
                         "op_ms": measured[s_].trace.to_dataframe().groupby("lane")["dur_ms"].sum().to_dict()}
                    for s_ in mk},
                 "predicted_ooo_ms": measured["ooo"].schedule.makespan_us / 1e3,
                 "median_subgraph_error": float(np.median(np.abs(err)))},
    "hetero_measured": {"tokens": N, "makespan_ms": meas, "predicted_speedup_vs_padding": pred["speedup_vs_padding"],
                        "predicted_total_ms": pred["total_ms"], "npu_gops": hp.npu_gops, "gpu_gflops": hp.gpu_gflops}}"""),
])

nb3 = new_notebook(metadata=KERNEL, cells=[
md("""# 03 · How sparse are SmolLM2's FFNs, and what would flash streaming cost?

**Question.** LLM in a flash keeps FFN neurons on flash and loads only the active ones, helped by a
sliding window of recently active neurons and a low-rank predictor; PowerInfer and DejaVu exploit the
same sparsity. Their models are ReLU models (OPT, ReLU-fied Llama) where > 90 % of FFN activations are
exactly zero. SmolLM2 uses SiLU: how many neurons can be treated as inactive, what does a sliding
window load per token, and can a small predictor find the active ones?

**Rule used here.** At `ffn_act` (the down-projection input), neuron j is inactive when |a_j| ≤ τ_i, τ_i
per layer the largest threshold that changes the FFN output by at most ε = 1 % (relative L2) on
calibration tokens; the achieved error is measured again on the profiled tokens."""),
code("""import os
from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.profile.jobs import profile_sparsity
from edgeprobe.profile import train_predictors

MODEL = os.environ.get("EDGEPROBE_NB_MODEL", "smollm2-135m")  # or "gemma3-270m" (GeGLU), or a GGUF path
TOKENS = int(os.environ.get("EDGEPROBE_NB_TOKENS", 16384))
WINDOW = min(512, TOKENS // 4)
model = models.load(MODEL)
ids = model.tokenizer.encode(read_corpus("train"))
stats = profile_sparsity(model, ids, tokens=TOKENS, window=WINDOW, eps=0.01)
s = stats.summary(bits=4)
print(f"{s['tokens']:,} tokens: {100 * s['inactive_fraction_mean']:.1f}% of neurons inactive on average "
      f"(layers {100 * s['inactive_fraction_min']:.0f}-{100 * s['inactive_fraction_max']:.0f}%), "
      f"FFN output error {100 * s['achieved_error_mean']:.2f}% (target 1%)")
print("paper (ReLU OPT): > 90% of FFN activations are zero")"""),
code("""stats.figure("inactive")"""),
md("## Hot and cold neurons"),
code("""stats.figure("frequency")"""),
code("""print(f"80% of firings come from {s['hot_neurons_pct_for_80pct_mean']:.0f}% of neurons (per layer, mean)")"""),
md("## Sliding window: resident neurons and flash traffic per token"),
code("""stats.figure("window")"""),
code("""dense = 3 * model.config.hidden * model.config.ffn * 4 / 8
for k, w in s["window"].items():
    print(f"k={k:>2}: {w['resident']:7.1f} resident, {w['new_per_token']:6.1f} new/token, "
          f"{w['flash_bytes_per_token_per_layer'] / 1024:6.1f} KiB/token/layer at 4 bits "
          f"({100 * w['fraction_of_dense_ffn_bytes']:.2f}% of the dense FFN); reads: "
          f"{w['reads_bundled']:.0f} bundled of {s['bundle_bytes']:.0f} B vs {w['reads_unbundled']:.0f} of {s['row_bytes']:.0f} B")"""),
md("## A low-rank predictor of the active set"),
code("""n_train = 2 * WINDOW
rep = train_predictors(model, ids[:n_train], ids[n_train:n_train + WINDOW], stats.params["thresholds"],
                       rank=32, window=WINDOW, steps=40 if TOKENS >= 4096 else 10)   # the suite's small run: 10 steps
p = rep.summary()
print(f"rank {p['rank']}: recall {p['recall_mean']:.3f}, precision {p['precision_mean']:.3f}, "
      f"predicts {100 * p['predicted_fraction_mean']:.0f}% of neurons active, "
      f"FFN output error {100 * p['ffn_error_mean']:.1f}% when only those are computed")"""),
md("""## The error budget: how many more neurons each extra percent of FFN error lets us drop

Thresholds recalibrated at other ε on the first calibration tokens (a coarser bisection than the profile's, to
stay quick)."""),
code("""import numpy as np
import plotly.graph_objects as go
from edgeprobe.forward import forward
from edgeprobe.profile.sparsity import calibrate_thresholds

SWEEP = min(WINDOW, 128)
acts = {}
forward(model, ids[:SWEEP], hooks=lambda n, x: acts.__setitem__(n, x.copy()) if n.endswith(".ffn_act") else None,
        logits="none")
budget = {}
for eps in (0.005, 0.01, 0.03):
    taus = calibrate_thresholds(model, ids, eps=eps, tokens=SWEEP, iters=10)
    budget[eps] = (taus, float(np.mean([(np.abs(acts[f"blk.{i}.ffn_act"]) <= taus[i]).mean() for i in taus])))
    print(f"eps {100 * eps:3.1f}%: {100 * budget[eps][1]:5.1f}% of neurons inactive on {SWEEP} calibration tokens")
go.Figure(go.Scatter(x=[100 * e for e in budget], y=[100 * v for _, v in budget.values()], mode="lines+markers")
          ).update_layout(title=f"Inactive neurons against the tolerated FFN output error ({model.name}, {model.config.act_fn})",
                          xaxis_title="tolerated FFN output error ε (%)", yaxis_title="neurons inactive (%)")"""),
md("""## What we found

Measured on SmolLM2-135M with 16,384 tokens (rerun the cells for live numbers):

- **Sparsity: disagrees, as expected for SiLU.** At 1 % FFN-output error only about a fifth of the neurons
  can be dropped per token (most layers 12–18 %; the first and last layers and the massive-activation
  layer 11 much more). The > 90 % of ReLU models does not carry over: SiLU models need ReLU-fication
  (as in PowerInfer / "ReLU strikes back") before flash streaming pays.
- **Hot/cold: weak.** About three quarters of the neurons are needed for 80 % of firings: no small hot
  set to pin in DRAM.
- **Sliding window: agrees in mechanism.** Because most neurons fire often, a window of a few tokens
  makes nearly all of them resident and new loads per token fall steeply with k (see the table): the
  window trades DRAM for flash traffic exactly as the paper describes, just with less to gain here.
  Bundling reads gate row, up row and down column in one read: the same bytes in a third of the reads.
- **Predictor: weak on SiLU.** A rank-32 predictor reaches ≈94 % recall only by predicting most neurons
  active (≈92 %), and the neurons it misses still carry ≈11 % of the FFN output: the paper's predictors were
  built for ReLU's exact zeros.
- **The error budget buys sparsity slowly**: on 128 calibration tokens ε = 0.5 / 1 / 3 % leaves 15 / 21 / 34 % of
  the neurons inactive: even a 3 % error in every FFN's output keeps two thirds of a SiLU FFN active."""),
results("03_sparsity", """results = {"model": MODEL, "act_fn": model.config.act_fn, "tokens": s["tokens"], "window": WINDOW, "eps": s["eps"], "ffn": model.config.ffn, "sweep_tokens": SWEEP,
           "inactive_fraction_mean": s["inactive_fraction_mean"], "inactive_fraction_min": s["inactive_fraction_min"],
           "inactive_fraction_max": s["inactive_fraction_max"], "inactive_fraction_per_layer": s["inactive_fraction_per_layer"],
           "thresholds": stats.params["thresholds"], "achieved_error_mean": s["achieved_error_mean"],
           "achieved_error_max": s["achieved_error_max"], "hot_neurons_pct_for_80pct_mean": s["hot_neurons_pct_for_80pct_mean"],
           "sliding_window": s["window"],
           "error_budget": {str(e): {"inactive_fraction": v, "thresholds": [taus[i] for i in sorted(taus)]}
                            for e, (taus, v) in budget.items()},
           "predictor": {k: p[k] for k in ("rank", "recall_mean", "precision_mean", "predicted_fraction_mean", "ffn_error_mean")}}"""),
])


nb4 = new_notebook(metadata=KERNEL, cells=[
md("""# 04 · Which quantization survives on SmolLM2, and what does it cost?

**Question.** The papers quantize for phone NPUs in different ways: per-tensor W8A8 with float shadow
outliers (mllm-NPU), weight-only W4A16 (HeteroLLM), 4-bit groups laid out in the HMX tiles (NPU test-time
scaling), outlier columns in float (LLM.int8()), smoothing (SmoothQuant). On the same real model and the
same text: how much perplexity does each lose, how often does it still pick float's top-1 token, and
how many bytes does it need — resident and on flash?

mllm-NPU's Table 5 leads us to expect `w8a8-shadow` within ~1–2 % of float and plain per-tensor `w8a8`
visibly worse. The integer arithmetic here is the device's: int8×int8→int32 GEMMs, vlut16 dequantization,
HMX tile order."""),
code("""import os
import numpy as np
from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.quant import calibration_profile
from edgeprobe.quant.report import accuracy_table, format_table

# the table covers every model named; the sections below study the first one
MODELS = os.environ.get("EDGEPROBE_NB_MODEL", "smollm2-135m,gemma3-270m").split(",")
WINDOW = int(os.environ.get("EDGEPROBE_NB_WINDOW", 512))      # the test suite runs this notebook small
WINDOWS = int(os.environ.get("EDGEPROBE_NB_WINDOWS", 8))
CALIB = int(os.environ.get("EDGEPROBE_NB_CALIB", 4096))
tables, quantized = {}, {}   # quantized: the first model's QuantizedModels, kept for the sections below
for name in MODELS:
    m = models.load(name)
    train, held = (m.tokenizer.encode(read_corpus(c)) for c in ("train", "heldout"))
    prof = calibration_profile(m, train, tokens=CALIB, window=min(WINDOW, CALIB))
    tables[name] = accuracy_table(m, held, prof, window=WINDOW, max_windows=WINDOWS,
                                  quantized=quantized if name == MODELS[0] else None)
    print(m.name, "-", WINDOWS, "held-out windows of", WINDOW, "tokens")
    print(format_table(tables[name]))
    print()
    if name == MODELS[0]:
        model, train, heldout, profile = m, train, held, prof
    del m
rows = tables[MODELS[0]]
print("paper (mllm-NPU Table 5): W8A8 + shadow outliers within ~1% of FP16; per-tensor W8A8 (SmoothQuant) loses 5-15%")"""),
md("""## Both models side by side

`channels in float` is the share of linear-input values (token × input channel) computed in float: all of them
for float, the shadow GEMM's outliers for the two shadow schemes, none for the pure integer and 4-bit schemes.
`w8a8-shadow` is the paper's exact variant (per-tensor weight and activation scales, clip at p99.99, 85% of
layers' outliers pruned); `w8a8c-shadow` keeps per-tensor int8 activations and the float shadow, but takes the
weights' scales per output channel (QNN/HTP's axis quantization) and clips at p99.1, so under 1% of values go to float."""),
code("""import plotly.graph_objects as go
cols = ["model", "scheme", "ppl", "vs float", "top-1 vs float", "weight MB", "channels in float"]
flat = [(name, r) for name in MODELS for r in tables[name]]
cells = [[n for n, _ in flat], [r["scheme"] for _, r in flat], [f"{r['perplexity']:.3f}" for _, r in flat],
         [("" if r["delta_vs_float_pct"] is None else f"{r['delta_vs_float_pct']:+.2f}%") for _, r in flat],
         [f"{100 * r['top1_agreement']:.1f}%" for _, r in flat], [f"{r['weight_bytes'] / 1e6:.1f}" for _, r in flat],
         [("n/a" if r["channels_in_float_pct"] is None else f"{r['channels_in_float_pct']:.2f}%") for _, r in flat]]
go.Figure(go.Table(header={"values": cols}, cells={"values": cells})).update_layout(
    title="Every scheme on every model: held-out perplexity, agreement with float, bytes, float share",
    height=90 + 24 * len(flat))"""),
code("""import plotly.graph_objects as go
fig = go.Figure(go.Scatter(x=[r["weight_bytes"] / 1e6 for r in rows], y=[r["delta_vs_float_pct"] for r in rows],
                           text=[r["scheme"] for r in rows], mode="markers+text", textposition="top center"))
fig.update_layout(title=f"Perplexity change vs linear-weight bytes ({model.name})", xaxis_title="linear weights (MB)",
                  yaxis_title="perplexity vs float (%)", yaxis_type="log")
fig"""),
md("## Where the error comes from: per-layer output error of each linear"),
code("""from edgeprobe.forward import forward
from edgeprobe.quant.schemes import INPUT_POINT
acts = {}
forward(model, heldout[:WINDOW], hooks=lambda n, x: acts.setdefault(n, x.copy()), logits="none")
schemes = ["w8a8", "w8a8-shadow", "w8a8c-shadow", "smoothquant", "llm-int8", "q4_0", "q4_0-tile"]
qms = {s: quantized[s] for s in schemes}   # the table's models: quantized once
L = model.config.n_layers
err = {s: np.zeros(L) for s in schemes}
for i in range(L):
    for op, point in INPUT_POINT.items():
        name, x = f"blk.{i}.{op}", acts[f"blk.{i}.{point}"]
        y = x @ model.weights[name + ".weight"].T
        for s in schemes:
            e = np.linalg.norm(qms[s].linear(name, x) - y) / np.linalg.norm(y)
            err[s][i] = max(err[s][i], e)
fig = go.Figure([go.Scatter(x=np.arange(L), y=100 * err[s], name=s, mode="lines+markers") for s in schemes])
fig.update_layout(title="Worst relative output error of a layer's linears", xaxis_title="layer",
                  yaxis_title="relative L2 error (%)", yaxis_type="log")
fig"""),
md("## The prune rate and the hot-channel coverage of `w8a8-shadow`"),
code("""# one w8a8-shadow model per (prune rate, coverage); the table's (0.85, 0.8: the defaults) is reused
shadow = {(0.85, 0.8): {"w8a8-shadow": quantized["w8a8-shadow"]}}

def shadow_row(prune_rate, coverage=0.8):
    return accuracy_table(model, heldout, profile, ["w8a8-shadow"], window=WINDOW, max_windows=max(1, WINDOWS // 4),
                          progress=False, prune_rate=prune_rate, coverage=coverage,
                          quantized=shadow.setdefault((prune_rate, coverage), {}))[0]

prune_rows = []
for pr in (0.0, 0.5, 0.85, 1.0):
    r = shadow_row(pr)
    prune_rows.append((pr, r["perplexity"], r["cold_bytes_read"]))
    print(f"prune rate {pr:4.2f}: perplexity {r['perplexity']:.3f}, cold shadow rows read {r['cold_bytes_read'] / 1e3:.0f} kB")
cov_rows = []
for cov in (0.5, 0.8, 0.95, 1.0):
    r = shadow_row(0.0, cov)
    cov_rows.append((cov, r["shadow_resident_bytes"], r["cold_bytes_read"], r["perplexity"]))
    print(f"coverage {cov:4.2f}: resident shadow rows {r['shadow_resident_bytes'] / 1e6:.2f} MB, "
          f"read from flash {r['cold_bytes_read'] / 1e3:.0f} kB, perplexity {r['perplexity']:.3f}")"""),
code("""from plotly.subplots import make_subplots
fig = make_subplots(rows=1, cols=2, subplot_titles=("prune rate → perplexity", "coverage → shadow bytes"))
fig.add_scatter(x=[p for p, _, _ in prune_rows], y=[v for _, v, _ in prune_rows], mode="lines+markers", name="perplexity", row=1, col=1)
fig.add_scatter(x=[c for c, *_ in cov_rows], y=[r / 1e6 for _, r, _, _ in cov_rows], mode="lines+markers", name="resident MB", row=1, col=2)
fig.add_scatter(x=[c for c, *_ in cov_rows], y=[f / 1e6 for _, _, f, _ in cov_rows], mode="lines+markers", name="read from flash MB", row=1, col=2)
fig.update_layout(title="w8a8-shadow: what pruning costs in accuracy, what coverage costs in memory")
fig"""),
md("""## What we found

Measured on SmolLM2-135M, 8 held-out windows of 512 tokens, clips at p99.99 of |x| from 4,096 calibration
tokens (rerun the cells for live numbers):

- **Plain per-tensor W8A8 breaks the model** (perplexity ×5, top-1 agreement ≈ 45 %): the paper's direction,
  far stronger here — SmolLM2 has massive activations (layer 11) that a per-tensor scale cannot hold.
- **W8A8 with shadow outliers repairs most of it** (about +17 % at the paper's 85 % prune rate, about +9 %
  with no pruning), but not to the paper's ≈1 %. Measured separately: per-tensor int8 *weights* alone cost
  +5.3 % (per-row int8 weights: +0.3 %), int8 activations with shadow outliers +3.1 %, and pruning the outliers of
  85 % of the layers another ≈7 %. A 135M model with 576-wide layers has less redundancy than Qwen1.5-1.8B;
  per-tensor weight scales and aggressive pruning are what the paper's setting hides.
- **LLM.int8()** (outlier columns in float, vector-wise int8) stays within ≈2 % — at the price of dynamic
  per-token scales an NPU does not offer.
- **Q4_0 and tile-group Q4_0 lose 25–35 %**: this checkpoint is already Q4_1, so re-quantizing to another 4-bit
  grid stacks two rounding errors; the tile order costs a few points more than row order here (the paper saw
  nearly none on a float checkpoint).
- Coverage trades memory for flash reads without touching accuracy; the prune rate trades accuracy for CPU work.
- **Per-channel weight scales close the gap** (`w8a8c-shadow`; 8 held-out windows of 256 tokens, 4,096 calibration
  tokens): SmolLM2 15.957 against float 15.867 (**+0.57 %**, top-1 97.1 %, 0.88 % of activation values in float),
  Gemma 3 270M 79.806 against 78.895 (**+1.15 %**, top-1 94.3 %, 0.92 % in float); at p99.0 instead: +0.23 % and
  +1.89 % with 1.0 % in float. The paper's per-tensor variant
  loses +22.9 % and +27.0 % on the same windows. What it needs is what HTP offers: int8 weights with a scale per
  output channel; activations stay per-tensor int8, statically calibrated, and the float shadow GEMM takes the 1 %
  of values above a p99.1 clip (every layer keeps its shadow; pruning with a tight clip would be catastrophic). The
  price is flash: every layer's float rows are there to be read (400 MB on Gemma, of which ~1 % is touched).
- **Gemma 3** on the same windows: plain per-tensor W8A8 +42 %, tile-group Q4_0 +15 % (its checkpoint is Q4_K_M).
  Per linear, int8 per-channel weights and p99-clipped int8 activations each add about 1 % relative output error on
  both models (v_proj worst, up to 2.5 % in Gemma's last layers); Gemma's perplexity feels it about eight times as
  much as SmolLM2's."""),
results("04_quantization", """results = {"window": WINDOW, "windows": WINDOWS, "calib_tokens": CALIB, "models": MODELS,
           "tables": {n: {r["scheme"]: {k: r[k] for k in ("perplexity", "delta_vs_float_pct", "top1_agreement",
                                                          "weight_bytes", "channels_in_float_pct", "tokens_scored")}
                          for r in tables[n]} for n in MODELS},
           "schemes": {r["scheme"]: {k: r[k] for k in ("perplexity", "delta_vs_float_pct", "top1_agreement", "weight_bytes",
                                                       "tokens_scored")} for r in rows},
           "layer_error": {s_: err[s_].tolist() for s_ in schemes}, "pruned_layers_at_0.85": profile.pruned_layers(0.85),
           "prune_rate": [{"prune_rate": pr, "perplexity": v, "cold_bytes_read": c} for pr, v, c in prune_rows],
           "coverage": [{"coverage": c, "shadow_resident_bytes": r, "cold_bytes_read": f, "perplexity": v}
                        for c, r, f, v in cov_rows]}"""),
])

HERE = __import__("pathlib").Path(__file__).resolve().parent
nb7 = new_notebook(metadata=KERNEL, cells=[
md("""# 07 · What does decoding cost on the device, and what do batching and flash streaming buy?

**Question.** In the decode phase every token re-reads the weights. Three papers attack that: the NPU test-time
scaling paper decodes a *batch* of candidates at almost the cost of one (the matrix unit idles on single-token
GEMVs); EdgeMoE streams *experts* from storage and hides the reads behind compute; LLM in a flash streams *FFN
neurons* with a sliding window and row-column bundles. HeteroLLM row-cuts decode matmuls across GPU and NPU. We
measure each on the agent, token by token, with the timeline.

Paper numbers: batching N candidates costs "little more than one" (NPU TTS §3.2); EdgeMoE's preloading and expert
buffer give large per-token speed-ups over loading every expert on demand (Fig. 16), with buffer hit rates well
above frequency-only caching; LLM in a flash loads only a few % of FFN weights per token on ReLU models (>90%
sparsity) and runs 4–5× (CPU) faster than naive loading."""),
code("""import os
import statistics
import numpy as np
import plotly.graph_objects as go
from edgeprobe import models, Device
from edgeprobe.corpus import read_corpus
from edgeprobe.quant import quantize
from edgeprobe.generate import replay
from edgeprobe.trace import cosine

FULL = int(os.environ.get("EDGEPROBE_NB_PROMPT", 256)) >= 256   # the test suite runs everything small
STEPS = 16 if FULL else 3
smollm = models.load("smollm2-135m")
held = smollm.tokenizer.encode(read_corpus("heldout"))
prompt = held[1000:1032]
dev = Device.local()
print(dev.info["lanes"], "| npu lane emulated on", dev.info["cpu"])"""),
md("## Decode on the agent: the KV cache stays there, each step is one group of the trace"),
code("""qm = quantize(smollm, "q4_0-tile")
d = dev.generate(qm, prompt, STEPS, progress=False)
host = replay(qm.model, prompt, d.tokens, linear=qm.linear)
flt = replay(smollm, prompt, d.tokens)      # the float model fed the same tokens
cos_host = min(cosine(a[0], b[0]) for a, b in zip(d.logits, host))
cos_float = min(cosine(a[0], b[0]) for a, b in zip(d.logits, flt))
print(f"ours: {STEPS} steps, median {statistics.median(d.step_ms):.1f} ms per step on the agent, "
      f"{d.decode_tok_per_s:.1f} tok/s (wall); logits vs the host's simulation: cosine >= {cos_host:.6f}, "
      f"vs the float model >= {cos_float:.4f}")
print("paper (llama.cpp on this machine, MACHINE.md): SmolLM2 decode 131 tok/s with 2 threads and fused kernels")
print("continuation:", repr(smollm.tokenizer.decode(d.tokens[0].tolist())))
d.trace.figure(f"decode timeline: prefill {len(prompt)} tokens, then {STEPS} steps (npu lane emulated)")"""),
md("## Test-time scaling: tokens/s by batch size (NPU TTS §3.2, Fig. 11)"),
code("""batches = (1, 2, 4, 8, 16) if FULL else (1, 4)
tps = {}
for b in batches:
    r = dev.generate(qm, prompt, STEPS, batch=b, temperature=0.8, seed=0, progress=False)
    tps[b] = b / statistics.median(r.step_ms) * 1e3
for b in batches:
    print(f"ours: batch {b:2d}: {tps[b]:6.1f} tok/s summed over the batch = {tps[b] / tps[1]:.2f}x batch 1")
print("paper: a batch of candidates costs little more than one on the NPU's matrix unit (HMX)")
go.Figure(go.Bar(x=[str(b) for b in batches], y=[tps[b] for b in batches])).update_layout(
    title="Decode throughput on the agent by batch (q4_0-tile, emulated NPU lane)", xaxis_title="batch",
    yaxis_title="tokens/s summed over the batch")"""),
code("""from edgeprobe.tts import best_of_n
with dev.session(qm, len(prompt) + 8, progress=False) as s:
    cands = best_of_n(s, prompt, n=4, max_tokens=6 if FULL else 3, temperature=0.9, seed=1)
for c in cands:
    print(f"score {c.score:7.3f}  {smollm.tokenizer.decode(c.tokens)!r}")
print("Best-of-N on the agent: one prefill, forked into 4, decoded as one batch, scored by the model's own mean log-prob")"""),
md("## Experts from flash (EdgeMoE §3.3, Fig. 16) on tiny-moe"),
code("""import dataclasses
from edgeprobe.plan import attach_expert_streaming
from edgeprobe.profile import run
from edgeprobe.profile.experts import CoActivationStats, PreloadPredictor, record_routing
from edgeprobe.profile.expert_cache import preload_plan, simulate

moe = models.load("tiny-moe")
stats = run(moe, moe.tokenizer.encode(read_corpus("train")), CoActivationStats.for_model(moe), window=256,
            max_tokens=32768 if FULL else 2048, progress=False)
pred = PreloadPredictor.from_stats(stats)
fp, q4 = quantize(moe, "float"), quantize(moe, "moe-mixed", expert_bits={})   # every expert INT4
for m_ in (fp, q4):
    attach_expert_streaming(m_, pred)
mprompt = moe.tokenizer.encode(read_corpus("heldout"))[500:532]
rows = [("all resident", fp, None), ("float, from flash", fp, {"capacity": 0}), ("+ INT4 experts", q4, {"capacity": 0}),
        ("+ preloading", q4, {"capacity": 0, "preload_n": 2}),
        ("+ buffer (24, edgemoe)", q4, {"capacity": 24, "policy": "edgemoe", "preload_n": 2})]
ablation = []
for name, m_, fl in rows:
    r = dev.generate(m_, mprompt, STEPS, experts_flash=fl, progress=False)
    c = r.step_counters
    hit = sum(x.get("experts_hits", 0) for x in c) / max(sum(x.get("experts_uses", 0) for x in c), 1)
    ablation.append((name, statistics.median(r.step_ms), np.mean([x["flash_read_bytes"] for x in c]) / 1e6, hit, r))
    print(f"ours: {name:<24} {ablation[-1][1]:6.1f} ms/token  {ablation[-1][2]:5.2f} MB read/token  hit rate {100 * hit:5.1f}%")
last = ablation[-1][4]
seq = np.concatenate([mprompt, last.tokens[0]])
tr = record_routing(moe, seq, window=len(seq), progress=False)
sub = dataclasses.replace(tr, experts=tr.experts[len(mprompt) + 1:], weights=tr.weights[len(mprompt) + 1:], starts=np.array([0]))
sim = simulate(sub, "edgemoe", 24, pred.p0, preload_plan(sub, pred, 2))
print(f"simulator on the same tokens' routing (cold buffer): hit rate {100 * sim['hit_rate']:.1f}%")
print("paper: preloading + the expert buffer hide most expert reads (Fig. 16); buffer hit rates well above frequency caching")
go.Figure(go.Bar(x=[a[0] for a in ablation], y=[a[1] for a in ablation])).update_layout(
    title="tiny-moe decode latency per token on the agent (Fig. 16 ablation)", yaxis_title="ms / token")"""),
code("""last.trace.figure("tiny-moe decode with the expert buffer: preloads on the io lane overlap compute")"""),
md("## Neurons from flash (LLM in a flash) on SmolLM2"),
code("""from edgeprobe.neurons import add_bundles, sparsity_perplexity
from edgeprobe.profile.predictor import train_predictors
from edgeprobe.profile.sparsity import calibrate_thresholds

train = smollm.tokenizer.encode(read_corpus("train"))
taus = calibrate_thresholds(smollm, train, eps=0.01, tokens=512 if FULL else 128)
npred = train_predictors(smollm, train[:4096 if FULL else 256], held[:512 if FULL else 128], taus, rank=32,
                         steps=40 if FULL else 3, window=256 if FULL else 128, target_recall=0.99, progress=False)
ppl = sparsity_perplexity(smollm, npred, held[4096:], window=256 if FULL else 64, max_windows=4 if FULL else 1)
print(f"ours: predictors keep {100 * npred.predicted_fraction.mean():.1f}% of neurons (recall {npred.recall.mean():.3f}); "
      f"perplexity {ppl['dense_ppl']:.2f} -> {ppl['sparse_ppl']:.2f} (+{100 * ppl['ppl_increase']:.1f}%)")
print("paper: ReLU models leave > 90% of FFN outputs at zero; SmolLM2 uses SiLU")
fq = quantize(smollm, "float")
add_bundles(fq, smollm, npred)
modes = [("all resident", None), ("sparse + window 5", {"mode": "sparse", "window": 5}),
         ("dense from flash", {"mode": "dense"})]
nrows = []
for name, mode in modes:
    r = dev.generate(fq, prompt, STEPS, ffn_flash=mode, progress=False)
    nrows.append((name, statistics.median(r.step_ms[1:] or r.step_ms),
                  np.mean([x["flash_read_bytes"] for x in (r.step_counters[1:] or r.step_counters)]) / 1e6))
    print(f"ours: {name:<18} {nrows[-1][1]:7.1f} ms/token  {nrows[-1][2]:8.2f} MB read from flash/token")
print("paper: the window + bundling read a small fraction of the FFN per token; dense loading reads all of it")
go.Figure(go.Bar(x=[r[0] for r in nrows], y=[r[2] for r in nrows])).update_layout(
    title="FFN bytes read from flash per decoded token (SmolLM2, cold reads)", yaxis_title="MB / token", yaxis_type="log")"""),
md("## HeteroLLM decode row-cut: gpu (OpenCL) and npu (emulated) lanes together"),
code("""from edgeprobe.quant import calibration_profile
from edgeprobe.schedule import decode_choices
w8 = quantize(smollm, "w8a8", calibration_profile(smollm, train, tokens=512 if FULL else 128, window=256 if FULL else 128,
                                                 progress=False))
hp, _ = dev.measure_linears(w8, rows=(1, 2, 4))
rc = {}
for strat in ("solver", "npu-pad", "gpu", "row-cut"):
    r = dev.generate(w8, prompt, STEPS, split=decode_choices(smollm.config, 1, hp, strat), progress=False)
    rc[strat] = statistics.median(r.step_ms)
dev.close()
print(f"ours: decode step {rc['solver']:.0f} ms with the solver's split vs npu alone {rc['npu-pad']:.0f}, gpu alone "
      f"{rc['gpu']:.0f}, forced row cut {rc['row-cut']:.0f} (lanes slow each other: npu x{hp.slowdown_npu:.1f})")
print("paper: row-cutting decode matmuls uses both processors' memory bandwidth")
go.Figure(go.Bar(x=list(rc), y=list(rc.values()))).update_layout(title="SmolLM2 w8a8 decode step by partition",
                                                                  yaxis_title="ms / step")"""),
md("""## What we found

Measured on this machine's agent (`python bench/decode.py`, 16 steps; the notebook reruns them live):

- **Decode on the agent** matches the host's simulation at every step (cosine ≥ 0.9999). SmolLM2 q4_0-tile decodes
  at ≈ 80–110 ms per step (≈ 10–12 tok/s): the emulated NPU lane is one CPU core running dequantized FP32 GEMVs, and
  ~600 ops per step each pay the executor's hand-off; llama.cpp's fused kernels reach 131 tok/s here.
- **Test-time scaling**: batch 2 / 4 / 8 / 16 give 1.2–1.3× / 2.2–2.3× / 3.7× / 5.8–7.0× the tokens/s of batch 1. A batch
  costs more than one sequence here because one CPU core is compute-bound at 16 rows; the weight-streaming part is
  shared, which is the paper's effect, but a HMX tile unit would make it nearly free.
- **Experts from flash** (tiny-moe, 16 steps): all resident 6.7 ms/token; float experts read on every use 33.6 ms
  (9.4 MB/token); INT4 experts 31.6 ms (1.2 MB/token: 8× fewer bytes, but dequantizing at each use costs what the
  reads saved); + preloading: 69% of uses found preloaded, latency unchanged (the I/O thread shares the two
  cores); + a 24-expert buffer (EdgeMoE policy) 22.8 ms, 0.47 MB/token, hit rate 82% (simulator on the same
  routing: 84%); LRU at the same size 70% (simulator 77%).
- **Neurons from flash** (SmolLM2): the sliding window (k = 5) reads 0.55 MB per token against 159 MB for dense
  loading (cold reads, page cache dropped), 73 ms per token against 486 ms — close to all-resident (62 ms). But
  SmolLM2's SiLU FFN is not sparse enough to predict cheaply: at 95% recall the predictors keep 92% of neurons and
  perplexity rises +289% (16.3 → 63.4); at 99% recall they keep 98% and it rises +10% (16.3 → 17.9). The mechanism
  works; the model is the wrong kind (the paper relies on ReLU sparsity).
- **HeteroLLM decode row-cut**: with the lanes' measured slowdown when both run (npu ×1.8–5.2, they share two
  cores), the solver keeps decode on one lane (1.04–1.09× the npu alone, 1.0–1.3× the gpu alone); a forced
  row cut is 0.55–0.75× — the two-processor bandwidth gain needs two processors."""),
results("07_decoding", """from edgeprobe.quant.expert_bits import expert_nbytes
results = {"steps": STEPS, "prompt": len(prompt), "decode_tok_per_s": d.decode_tok_per_s,
           "step_ms_median": statistics.median(d.step_ms), "cosine_vs_host_min": cos_host, "cosine_vs_float_min": cos_float,
           "batch_tok_per_s": {str(b): v for b, v in tps.items()},
           "best_of_n": [{"score": c.score, "tokens": len(c.tokens)} for c in cands],
           "experts": [{"name": a[0], "ms_per_token": a[1], "mb_per_token": a[2], "hit_rate": a[3]} for a in ablation],
           "expert_uses_per_token": moe.config.n_layers * moe.config.n_experts_used,
           "expert_bytes": {"float": 3 * moe.config.hidden * moe.config.expert_ffn * 4, "int4": expert_nbytes(moe.config, 4)},
           "simulator_hit_rate": sim["hit_rate"],
           "neurons": {"predicted_fraction": float(npred.predicted_fraction.mean()), "recall": float(npred.recall.mean()),
                       "dense_ppl": ppl["dense_ppl"], "sparse_ppl": ppl["sparse_ppl"],
                       "modes": [{"name": n_, "ms_per_token": t_, "mb_per_token": b_} for n_, t_, b_ in nrows]},
           "rowcut_step_ms": rc}"""),
])


def write(nb, name: str) -> None:
    """Cell ids from the file name and position, so rebuilding changes only what changed."""
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{name.split('_')[0]}-{i:02d}"
    nbf.write(nb, HERE / name)


write(nb1, "01_outliers.ipynb")
write(nb2, "02_experts.ipynb")
write(nb3, "03_sparsity.ipynb")
write(nb4, "04_quantization.ipynb")
write(nb5, "05_device_timeline.ipynb")
write(nb6, "06_scheduling.ipynb")
write(nb7, "07_decoding.ipynb")
