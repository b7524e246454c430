# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · How sparse are SmolLM2's FFNs, and what would flash streaming cost?
#
# **Question.** LLM in a flash keeps FFN neurons on flash and loads only the active ones, helped by a
# sliding window of recently active neurons and a low-rank predictor; PowerInfer and DejaVu exploit the
# same sparsity. Their models are ReLU models (OPT, ReLU-fied Llama) where > 90 % of FFN activations are
# exactly zero. SmolLM2 uses SiLU: how many neurons can be treated as inactive, what does a sliding
# window load per token, and can a small predictor find the active ones?
#
# **Rule used here.** At `ffn_act` (the down-projection input), neuron j is inactive when |a_j| ≤ τ_i, τ_i
# per layer the largest threshold that changes the FFN output by at most ε = 1 % (relative L2) on
# calibration tokens; the achieved error is measured again on the profiled tokens.

# %%
import os

from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.profile import train_predictors
from edgeprobe.profile.jobs import profile_sparsity

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
print("paper (ReLU OPT): > 90% of FFN activations are zero")

# %%
stats.figure("inactive")

# %% [markdown]
# ## Hot and cold neurons

# %%
stats.figure("frequency")

# %%
print(f"80% of firings come from {s['hot_neurons_pct_for_80pct_mean']:.0f}% of neurons (per layer, mean)")

# %% [markdown]
# ## Sliding window: resident neurons and flash traffic per token

# %%
stats.figure("window")

# %%
dense = 3 * model.config.hidden * model.config.ffn * 4 / 8
for k, w in s["window"].items():
    print(f"k={k:>2}: {w['resident']:7.1f} resident, {w['new_per_token']:6.1f} new/token, "
          f"{w['flash_bytes_per_token_per_layer'] / 1024:6.1f} KiB/token/layer at 4 bits "
          f"({100 * w['fraction_of_dense_ffn_bytes']:.2f}% of the dense FFN); reads: "
          f"{w['reads_bundled']:.0f} bundled of {s['bundle_bytes']:.0f} B "
          f"vs {w['reads_unbundled']:.0f} of {s['row_bytes']:.0f} B")

# %% [markdown]
# ## A low-rank predictor of the active set

# %%
n_train = 2 * WINDOW
rep = train_predictors(model, ids[:n_train], ids[n_train:n_train + WINDOW], stats.params["thresholds"],
                       rank=32, window=WINDOW, steps=40 if TOKENS >= 4096 else 10)   # the suite's small run: 10 steps
p = rep.summary()
print(f"rank {p['rank']}: recall {p['recall_mean']:.3f}, precision {p['precision_mean']:.3f}, "
      f"predicts {100 * p['predicted_fraction_mean']:.0f}% of neurons active, "
      f"FFN output error {100 * p['ffn_error_mean']:.1f}% when only those are computed")

# %% [markdown]
# ## The error budget: how many more neurons each extra percent of FFN error lets us drop
#
# Thresholds recalibrated at other ε on the first calibration tokens (a coarser bisection than the profile's, to
# stay quick).

# %%
import numpy as np
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
          ).update_layout(title="Inactive neurons against the tolerated FFN output error "
                                f"({model.name}, {model.config.act_fn})",
                          xaxis_title="tolerated FFN output error ε (%)", yaxis_title="neurons inactive (%)")

# %%
# the headline numbers as data (tests/test_notebooks.py checks them)
import json
import pathlib

RESULTS_DIR = pathlib.Path(os.environ.get("EDGEPROBE_NB_RESULTS", "out"))
RESULTS_DIR.mkdir(parents=True, exist_ok=True)
results = {"model": MODEL, "act_fn": model.config.act_fn, "tokens": s["tokens"], "window": WINDOW, "eps": s["eps"],
           "ffn": model.config.ffn, "sweep_tokens": SWEEP,
           "inactive_fraction_mean": s["inactive_fraction_mean"], "inactive_fraction_min": s["inactive_fraction_min"],
           "inactive_fraction_max": s["inactive_fraction_max"],
           "inactive_fraction_per_layer": s["inactive_fraction_per_layer"],
           "thresholds": stats.params["thresholds"], "achieved_error_mean": s["achieved_error_mean"],
           "achieved_error_max": s["achieved_error_max"],
           "hot_neurons_pct_for_80pct_mean": s["hot_neurons_pct_for_80pct_mean"],
           "sliding_window": s["window"],
           "error_budget": {str(e): {"inactive_fraction": v, "thresholds": [taus[i] for i in sorted(taus)]}
                            for e, (taus, v) in budget.items()},
           "predictor": {k: p[k] for k in ("rank", "recall_mean", "precision_mean", "predicted_fraction_mean",
                                           "ffn_error_mean")}}
(RESULTS_DIR / "03_sparsity.json").write_text(json.dumps(results, indent=1, default=float))
print(f"headline numbers written to {RESULTS_DIR / '03_sparsity.json'}: {', '.join(results)}")

# %% [markdown]
# ## What we found
#
# Rendered from this run's numbers: the cell below reads what the cells above computed.

# %%
from IPython.display import Markdown

inact, per_layer = s["inactive_fraction_mean"], np.array(s["inactive_fraction_per_layer"])
ks = sorted(s["window"], key=int)
w0, w1 = s["window"][ks[0]], s["window"][ks[-1]]
relu_like = inact > 0.9
Markdown(f"""Measured on {model.name} ({model.config.act_fn}, {model.config.ffn} FFN neurons per layer) with
{s["tokens"]:,} tokens.

- **Sparsity: {"agrees" if relu_like else "disagrees"} with the ReLU papers' > 90 %.** At {100 * s["eps"]:.0f} %
  FFN-output error {100 * inact:.1f}% of the neurons can be dropped per token on average (layers
  {100 * s["inactive_fraction_min"]:.0f}–{100 * s["inactive_fraction_max"]:.0f} %, most in layer
  {int(np.argmax(per_layer))}); the achieved error is {100 * s["achieved_error_mean"]:.2f}% on average.
  {"" if relu_like else "A SiLU/GELU model needs ReLU-fication (PowerInfer, 'ReLU strikes back') before flash "
   "streaming pays."}
- **Hot and cold neurons.** {s["hot_neurons_pct_for_80pct_mean"]:.0f}% of the neurons are needed for 80 % of
  firings (per layer, mean){": no small hot set to pin in DRAM" if s["hot_neurons_pct_for_80pct_mean"] > 30 else ""}.
- **Sliding window.** A window of {ks[0]} token(s) keeps {w0["resident"]:.0f} neurons resident and loads
  {w0["new_per_token"]:.0f} new ones per token; a window of {ks[-1]} keeps {w1["resident"]:.0f} and loads
  {w1["new_per_token"]:.0f} ({w1["new_per_token"] / w0["new_per_token"]:.0%} of the 1-token window's reads): the
  window trades DRAM for flash traffic as the paper describes. Bundling gate row, up row and down column reads
  the same bytes in {w1["reads_bundled"] / w1["reads_unbundled"]:.0%} of the reads.
- **Predictor.** A rank-{p["rank"]} predictor reaches {p["recall_mean"]:.1%} recall by predicting
  {p["predicted_fraction_mean"]:.0%} of the neurons active; the neurons it misses carry {p["ffn_error_mean"]:.1%} of
  the FFN output (the paper's predictors were built for ReLU's exact zeros).
- **The error budget**, on {SWEEP} calibration tokens: """ + ", ".join(
    f"ε = {100 * e:.1f} % leaves {100 * v:.0f}%" for e, (_, v) in budget.items()) + " of the neurons inactive.")
