# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · How do a real MoE's tokens move through its experts?
#
# **Question.** EdgeMoE keeps the experts of an MoE model on flash and loads only the routed ones. That pays
# only if routing has structure: which experts does a token use, how predictable is the next layer's
# choice from the previous ones, how few bits can each expert live with, and which buffer policy keeps the
# right experts in memory?
#
# EdgeMoE (docs/papers.md §3) measured on Switch Transformers: experts are used about evenly one by one, but
# **the top 20 % of activation paths cover over 99 % of tokens** (Fig. 4, a power law); the next layer's expert is
# predictable from the previous two — **P(E_n | E_n-1, E_n-2) reaches about 87 %** (Fig. 8); experts differ in how
# much INT2 hurts (Fig. 7a), so the least sensitive can go to INT2 within a tolerated loss P (Fig. 15); and its
# frequency-and-distance eviction policy beats FIFO/LRU/LFU at small buffers (Fig. 13).
#
# **Model.** `tiny-moe` — edgeprobe's own Mixtral-layout MoE (6 layers, 8 experts, top-2, hidden 256), trained
# on the bundled corpus by `datasets/moe/train_tiny_moe.py`; nothing is downloaded. A path is a token's top-1
# expert at every layer.

# %%
import json
import os

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
      f"after {metrics['training']['steps']} steps, {metrics['training']['seconds'] / 60:.1f} min "
      f"on {metrics['training']['threads']} CPU threads")
stats = run(model, train, CoActivationStats.for_model(model), window=WINDOW, max_tokens=TOKENS, desc="co-activation")
held = record_routing(model, heldout, WINDOW, max(WINDOW, TOKENS // 4))
s = stats.summary(held)
print(f"{stats.tokens:,} profiled tokens, {held.tokens:,} held-out tokens replayed")

# %% [markdown]
# ## Expert load: even one by one?

# %%
stats.figure("frequency")

# %%
lb = stats.load_balance()
print("ours : max/mean load per layer", np.round(lb["max_over_mean"], 2), "(1 = even);",
      "load entropy", np.round(lb["load_entropy_bits"], 2), "bits of 3")
print("       router entropy per token", np.round(lb["router_entropy_bits"], 2), "bits")
print("paper: experts are activated about evenly (EdgeMoE §2.2), which is why caching by popularity alone fails")

# %% [markdown]
# ## Fig. 4 — activation paths follow a power law

# %%
stats.figure("paths")

# %%
pl = s["path_power_law"]
print(f"ours : {pl['paths_observed']:,} distinct paths of {pl['paths_possible']:,} possible; top 20% of paths cover "
      f"{100 * s['top20pct_paths_token_share']:.1f}% of tokens; tokens ∝ rank^-{pl['alpha']:.2f} (R² {pl['r2']:.2f})")
print("paper: top 20% of paths cover > 99% of tokens (Switch Transformers)")

# %% [markdown]
# ## Fig. 8 — consecutive layers' experts are correlated

# %%
stats.figure("conditional")

# %%
print("ours : mean peak P(E_n | E_n-1)       per layer", s["conditional_peak_order1"])
print("       mean peak P(E_n | E_n-1, E_n-2) per layer", s["conditional_peak_order2"])
print("paper: P(E_n | E_n-1, E_n-2) up to about 87% (top-1 routing, so one expert per layer)")

# %% [markdown]
# ## The preload predictor on held-out tokens
#
# While layer n-1 computes, preload the n experts the table ranks highest for layer n. Hit rate = share of the
# experts layer n really uses that were preloaded.

# %%
stats.figure("predictor", heldout=held)

# %%
hr = s["predictor_hit_rate"]
for order in ("order0", "order1", "order2"):
    print(f"ours : {order}: " + ", ".join(f"top-{n} {100 * hr[order][f'top{n}']:.1f}%" for n in (1, 2, 3, 4)))
print("paper: preloading the predicted experts hides most expert I/O behind compute (Fig. 16)")

# %% [markdown]
# ## Fig. 7a — which experts tolerate INT2?
#
# Each expert alone at per-channel INT2 (ternary), all other experts at INT4, attention at INT8: the change in
# loss on calibration windows of the *training* split (the held-out text stays for evaluation).

# %%
from edgeprobe.quant import ExpertBitsStudy

study = ExpertBitsStudy(model, train, window=WINDOW, max_windows=WINDOWS)
study.measure_sensitivity()
study.figure("sensitivity")

# %%
sens = study.sensitivity
print(f"ours : INT2 on one expert costs {1000 * sens.min():.2f} to {1000 * sens.max():.2f} mnats "
      f"(median {1000 * np.median(sens):.2f}); the most sensitive expert costs "
      f"{sens.max() / max(np.median(sens), 1e-9):.1f}x the median")
print(f"       all experts INT2 / INT4 / INT8: {100 * np.expm1(study.uniform[2] - study.float_loss):+.1f}% / "
      f"{100 * np.expm1(study.uniform[4] - study.float_loss):+.2f}% / "
      f"{100 * np.expm1(study.uniform[8] - study.float_loss):+.2f}% perplexity")
print("paper: INT2 on single experts costs 0.44% to over 1% Rouge-2 and differs between experts (ST-base-8)")

# %% [markdown]
# ## Fig. 15 — model bytes against loss as the tolerated loss P varies

# %%
sels = study.curve((0.01, 0.02, 0.05, 0.1, 0.2, 0.5))
for x in sels:
    print(f"P = {100 * x.tolerance:4.0f}%: {x.k_low:2d} experts at INT{x.low}, rest INT{x.high}: "
          f"{x.model_bytes / 1e6:.2f} MB, perplexity +{100 * x.perplexity_increase:.2f}%")
print("paper: model size and latency fall as P grows from 5% to 20% (ST-base-8/16, Fig. 15)")
study.figure("tolerance", sels)

# %% [markdown]
# ## moe-mixed in the quantization table (held-out text)

# %%
from edgeprobe.quant.report import accuracy_table, format_table

sel = next(x for x in sels if x.tolerance == 0.05)
rows = accuracy_table(model, heldout, None, ["float", "llm-int8", "q4_0", "moe-mixed"], window=WINDOW,
                      max_windows=WINDOWS, expert_bits=sel.bits)
print(format_table(rows))
print("paper: EdgeMoE's accuracy loss lands close to the tolerated 5%")

# %% [markdown]
# ## Fig. 13 — expert buffer policies, with and without preloading

# %%
from edgeprobe.profile.expert_cache import sweep
from edgeprobe.profile.expert_figures import cache_figure
from edgeprobe.quant.expert_bits import expert_nbytes

eb = expert_nbytes(model.config, 4)
caps = [4, 8, 12, 16, 24, 32]
cache_rows = sweep(held, caps, stats.a["freq"], stats.predictor(2), expert_bytes=eb)
cache_figure(cache_rows, eb, f"{held.tokens:,} held-out tokens, INT4 experts of {eb / 1e3:.0f} kB")

# %%
for c in caps:
    r = {(x["policy"], x["preload"]): x for x in cache_rows if x["capacity"] == c}
    print(f"buffer {c:2d} experts: "
          + ", ".join(f"{p} {100 * r[(p, False)]['hit_rate']:.0f}%/{100 * r[(p, True)]['hit_rate']:.0f}%"
                      for p in ("fifo", "lru", "lfu", "edgemoe")) + "  (no preload / preload)")
print("paper: EdgeMoE's policy has the highest hit rate at every buffer size (Fig. 13)")

# %%
# the headline numbers as data (tests/test_notebooks.py checks them)
import pathlib

RESULTS_DIR = pathlib.Path(os.environ.get("EDGEPROBE_NB_RESULTS", "out"))
RESULTS_DIR.mkdir(parents=True, exist_ok=True)
np.save(RESULTS_DIR / "02_experts_routing.npy", np.asarray(held.experts))  # the replayed routing
results = {"tokens": stats.tokens, "heldout_tokens": held.tokens, "experts": model.config.n_experts,
           "layers": model.config.n_layers, "top_k": model.config.n_experts_used,
           "load_entropy_bits": lb["load_entropy_bits"].tolist(),
           "router_entropy_bits": lb["router_entropy_bits"].tolist(),
           "load_max_over_mean": lb["max_over_mean"].tolist(),
           "paths_observed": pl["paths_observed"], "paths_possible": pl["paths_possible"],
           "top20pct_paths_token_share": s["top20pct_paths_token_share"],
           "conditional_peak_order1": s["conditional_peak_order1"],
           "conditional_peak_order2": s["conditional_peak_order2"],
           "predictor_hit_rate": hr, "float_loss": study.float_loss,
           "uniform_loss": {f"int{b}": v for b, v in study.uniform.items()}, "sensitivity": sens.tolist(),
           "other_bytes": study.other_nbytes(),
           "tolerance_curve": [{k: v for k, v in x.to_dict().items() if k != "experts_by_bits"} for x in sels],
           "accuracy": {r["scheme"]: r["perplexity"] for r in rows},
           "cache": [{k: r[k] for k in ("policy", "capacity", "preload", "hit_rate")} for r in cache_rows],
           "routing": str((RESULTS_DIR / "02_experts_routing.npy").resolve())}
(RESULTS_DIR / "02_experts.json").write_text(json.dumps(results, indent=1, default=float))
print(f"headline numbers written to {RESULTS_DIR / '02_experts.json'}: {', '.join(results)}")

# %% [markdown]
# ## What we found
#
# Rendered from this run's numbers: the cell below reads what the cells above computed.

# %%
from IPython.display import Markdown


def span(xs, fmt=".2f"):
    """'a–b' over the values that exist (layer 0 has no previous layer)."""
    xs = [x for x in xs if x is not None]
    return f"{min(xs):{fmt}}–{max(xs):{fmt}}"


E, acc = model.config.n_experts, {r["scheme"]: r["perplexity"] for r in rows}
share, worst = s["top20pct_paths_token_share"], np.unravel_index(np.argmax(sens), sens.shape)
c1, c2 = s["conditional_peak_order1"], s["conditional_peak_order2"]
hit = {(x["policy"], x["capacity"], x["preload"]): x["hit_rate"] for x in cache_rows}
best = {c: max(("fifo", "lru", "lfu", "edgemoe"), key=lambda p: hit[(p, c, False)]) for c in caps}
lost = [c for c in caps if best[c] != "edgemoe"]
mixed = acc["moe-mixed"] / acc["float"] - 1
Markdown(f"""Measured on `tiny-moe` ({model.config.n_layers} layers, {E} experts, top-{model.config.n_experts_used})
with {stats.tokens:,} training-split tokens profiled and {held.tokens:,} held-out tokens replayed.

- **Load and routing.** Per-layer load entropy is {span(lb["load_entropy_bits"])} bits of {np.log2(E):.0f} (max/mean
  load {span(lb["max_over_mean"])}, least even in layer {int(np.argmax(lb["max_over_mean"]))}) while each token's
  router entropy is {span(lb["router_entropy_bits"])} bits: every expert is busy, yet each token's routing is
  {"decided" if max(lb["router_entropy_bits"]) < min(lb["load_entropy_bits"]) else "barely decided"} —
  EdgeMoE's premise.
- **Fig. 4 — paths.** {pl["paths_observed"]:,} distinct top-1 paths of {pl["paths_possible"]:,} possible; tokens per
  path fall as rank^-{pl["alpha"]:.2f} (R² {pl["r2"]:.2f}), and the top 20 % of paths cover **{100 * share:.0f}% of
  tokens** ({"as in" if share > 0.99 else "not"} the paper's > 99 %).
- **Fig. 8 — layer-to-layer correlation.** The best next expert given the previous two layers' top-1 experts has
  probability **{span(c2, ".0%")}** on average per layer (paper: up to about 87 %); given one layer only,
  {span(c1, ".0%")}.
- **Preloading.** On held-out tokens, preloading the table's top-2 experts catches
  **{hr["order2"]["top2"]:.0%} of the experts actually used** (order-1 table {hr["order1"]["top2"]:.0%}, frequency
  alone {hr["order0"]["top2"]:.0%}, random {2 / E:.0%}); top-4 catches {hr["order2"]["top4"]:.0%}.
- **Fig. 7a — experts differ.** One expert at INT2 costs {sens.min():.3f} to {sens.max():.3f} nats (median
  {np.median(sens):.3f}; the most sensitive: layer {worst[0]}, expert {worst[1]}). All experts at INT2 multiply
  perplexity by {np.exp(study.uniform[2] - study.float_loss):.1f}, INT4 costs
  {100 * np.expm1(study.uniform[4] - study.float_loss):+.1f}%.
- **Fig. 15 — the tolerance buys bytes.** """ + ", ".join(f"P = {x.tolerance:.0%} puts {x.k_low} experts at INT{x.low}"
                                                    for x in sels) + f""", the model going from
  {sels[0].model_bytes / 1e6:.2f} to {sels[-1].model_bytes / 1e6:.2f} MB; on the held-out text moe-mixed at P = 5 %
  costs **{100 * mixed:+.1f}%** perplexity (paper: the loss lands close to the tolerated 5 %; widths are chosen on
  training-split windows).
- **Fig. 13 — buffer policies.** Without preloading EdgeMoE's policy has the best hit rate at
  {len(caps) - len(lost)} of {len(caps)} buffer sizes""" + ("" if not lost else " (not at " + ", ".join(
    f"{c} experts: {best[c].upper()} {hit[(best[c], c, False)]:.0%} vs {hit[('edgemoe', c, False)]:.0%}"
    for c in lost) + ")") + f"""; preloading lifts it at {caps[len(caps) // 2]} experts from
  {hit[("edgemoe", caps[len(caps) // 2], False)]:.0%} to {hit[("edgemoe", caps[len(caps) // 2], True)]:.0%}.
  LFU is {"the worst at every size: nearly even load makes its counts uninformative"
           if all(min(("fifo", "lru", "lfu", "edgemoe"), key=lambda p: hit[(p, c, False)]) == "lfu" for c in caps)
           else "not the worst at every size"}.""")
