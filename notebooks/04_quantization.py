# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Which quantization survives on SmolLM2, and what does it cost?
#
# **Question.** The papers quantize for phone NPUs in different ways: per-tensor W8A8 with float shadow
# outliers (mllm-NPU), weight-only W4A16 (HeteroLLM), 4-bit groups laid out in the HMX tiles (NPU test-time
# scaling), outlier columns in float (LLM.int8()), smoothing (SmoothQuant). On the same real model and the
# same text: how much perplexity does each lose, how often does it still pick float's top-1 token, and
# how many bytes does it need — resident and on flash?
#
# mllm-NPU's Table 5 leads us to expect `w8a8-shadow` within ~1–2 % of float and plain per-tensor `w8a8`
# visibly worse. The integer arithmetic here is the device's: int8×int8→int32 GEMMs, vlut16 dequantization,
# HMX tile order.

# %%
import os

import numpy as np

from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.prepare import calibration, prepared
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
    # the calibration and the quantized models come from the prepared-model cache the demo, the CLI and the API share
    prof = calibration(m, say=print, tokens=CALIB, window=min(WINDOW, CALIB))
    tables[name] = accuracy_table(m, held, prof, window=WINDOW, max_windows=WINDOWS,
                                  quantized=quantized if name == MODELS[0] else None,
                                  prepare=lambda s, m=m: prepared(m, s, say=print, calib_tokens=CALIB,
                                                                  calib_window=min(WINDOW, CALIB)))
    print(m.name, "-", WINDOWS, "held-out windows of", WINDOW, "tokens")
    print(format_table(tables[name]))
    print()
    if name == MODELS[0]:
        model, train, heldout, profile = m, train, held, prof
    del m
rows = tables[MODELS[0]]
print("paper (mllm-NPU Table 5): W8A8 + shadow outliers within ~1% of FP16; per-tensor W8A8 (SmoothQuant) loses 5-15%")

# %% [markdown]
# ## Both models side by side
#
# `channels in float` is the share of linear-input values (token × input channel) computed in float: all of them
# for float, the shadow GEMM's outliers for the two shadow schemes, none for the pure integer and 4-bit schemes.
# `w8a8-shadow` is the paper's exact variant (per-tensor weight and activation scales, clip at p99.99, 85% of
# layers' outliers pruned); `w8a8c-shadow` keeps per-tensor int8 activations and the float shadow, but takes the
# weights' scales per output channel (QNN/HTP's axis quantization) and clips at p99.1, so under 1% of values go to
# float.

# %%
import plotly.graph_objects as go

cols = ["model", "scheme", "ppl", "vs float", "top-1 vs float", "weight MB", "channels in float"]
flat = [(name, r) for name in MODELS for r in tables[name]]
cells = [[n for n, _ in flat], [r["scheme"] for _, r in flat], [f"{r['perplexity']:.3f}" for _, r in flat],
         [("" if r["delta_vs_float_pct"] is None else f"{r['delta_vs_float_pct']:+.2f}%") for _, r in flat],
         [f"{100 * r['top1_agreement']:.1f}%" for _, r in flat], [f"{r['weight_bytes'] / 1e6:.1f}" for _, r in flat],
         [("n/a" if r["channels_in_float_pct"] is None else f"{r['channels_in_float_pct']:.2f}%") for _, r in flat]]
go.Figure(go.Table(header={"values": cols}, cells={"values": cells})).update_layout(
    title="Every scheme on every model: held-out perplexity, agreement with float, bytes, float share",
    height=90 + 24 * len(flat))

# %%
import plotly.graph_objects as go

fig = go.Figure(go.Scatter(x=[r["weight_bytes"] / 1e6 for r in rows], y=[r["delta_vs_float_pct"] for r in rows],
                           text=[r["scheme"] for r in rows], mode="markers+text", textposition="top center"))
fig.update_layout(title=f"Perplexity change vs linear-weight bytes ({model.name})", xaxis_title="linear weights (MB)",
                  yaxis_title="perplexity vs float (%)", yaxis_type="log")
fig

# %% [markdown]
# ## Where the error comes from: per-layer output error of each linear

# %%
from edgeprobe.forward import forward
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
worst = {s: int(np.argmax(err[s])) for s in schemes}
print("worst relative output error of a layer's linears: "
      + ", ".join(f"{s} {100 * err[s][worst[s]]:.1f}% (layer {worst[s]})" for s in schemes))

# %% [markdown]
# The same error as a signal-to-quantization-noise ratio per layer: each layer's seven linear outputs against
# float, in dB (every 6 dB is about one bit; higher is closer to float).

# %%
from edgeprobe.figures import layer_sqnr, sqnr_figure

sqnr = layer_sqnr(model, qms, acts)
sqnr_figure(sqnr, f"Per-layer SQNR of the linears, {model.name} ({WINDOW} held-out tokens)")

# %% [markdown]
# ## The prune rate and the hot-channel coverage of `w8a8-shadow`

# %%
# one w8a8-shadow model per (prune rate, coverage), from the cached calibration; these variants stay in memory (the
# prepared-model cache keeps the defaults, the table's (0.85, 0.8), which is reused)
shadow = {(0.85, 0.8): {"w8a8-shadow": quantized["w8a8-shadow"]}}

def shadow_row(prune_rate, coverage=0.8):
    return accuracy_table(model, heldout, profile, ["w8a8-shadow"], window=WINDOW, max_windows=max(1, WINDOWS // 4),
                          progress=False, prune_rate=prune_rate, coverage=coverage,
                          quantized=shadow.setdefault((prune_rate, coverage), {}))[0]

prune_rows = []
for pr in (0.0, 0.5, 0.85, 1.0):
    r = shadow_row(pr)
    prune_rows.append((pr, r["perplexity"], r["cold_bytes_read"]))
    print(f"prune rate {pr:4.2f}: perplexity {r['perplexity']:.3f}, "
          f"cold shadow rows read {r['cold_bytes_read'] / 1e3:.0f} kB")
cov_rows = []
for cov in (0.5, 0.8, 0.95, 1.0):
    r = shadow_row(0.0, cov)
    cov_rows.append((cov, r["shadow_resident_bytes"], r["cold_bytes_read"], r["perplexity"]))
    print(f"coverage {cov:4.2f}: resident shadow rows {r['shadow_resident_bytes'] / 1e6:.2f} MB, "
          f"read from flash {r['cold_bytes_read'] / 1e3:.0f} kB, perplexity {r['perplexity']:.3f}")

# %%
from plotly.subplots import make_subplots

fig = make_subplots(rows=1, cols=2, subplot_titles=("prune rate → perplexity", "coverage → shadow bytes"))
fig.add_scatter(x=[p for p, _, _ in prune_rows], y=[v for _, v, _ in prune_rows], mode="lines+markers",
                name="perplexity", row=1, col=1)
fig.add_scatter(x=[c for c, *_ in cov_rows], y=[r / 1e6 for _, r, _, _ in cov_rows], mode="lines+markers",
                name="resident MB", row=1, col=2)
fig.add_scatter(x=[c for c, *_ in cov_rows], y=[f / 1e6 for _, _, f, _ in cov_rows], mode="lines+markers",
                name="read from flash MB", row=1, col=2)
fig.update_layout(title="w8a8-shadow: what pruning costs in accuracy, what coverage costs in memory")
fig

# %%
# the headline numbers as data (tests/test_notebooks.py checks them)
import json
import pathlib

RESULTS_DIR = pathlib.Path(os.environ.get("EDGEPROBE_NB_RESULTS", "out"))
RESULTS_DIR.mkdir(parents=True, exist_ok=True)
results = {"window": WINDOW, "windows": WINDOWS, "calib_tokens": CALIB, "models": MODELS,
           "tables": {n: {r["scheme"]: {k: r[k] for k in ("perplexity", "delta_vs_float_pct", "top1_agreement",
                                                          "weight_bytes", "channels_in_float_pct", "tokens_scored")}
                          for r in tables[n]} for n in MODELS},
           "schemes": {r["scheme"]: {k: r[k] for k in ("perplexity", "delta_vs_float_pct", "top1_agreement",
                                                       "weight_bytes", "tokens_scored")} for r in rows},
           "layer_error": {s_: err[s_].tolist() for s_ in schemes},
           "layer_sqnr_db": {s_: sqnr[s_].tolist() for s_ in schemes},
           "pruned_layers_at_0.85": profile.pruned_layers(0.85),
           "prune_rate": [{"prune_rate": pr, "perplexity": v, "cold_bytes_read": c} for pr, v, c in prune_rows],
           "coverage": [{"coverage": c, "shadow_resident_bytes": r, "cold_bytes_read": f, "perplexity": v}
                        for c, r, f, v in cov_rows]}
(RESULTS_DIR / "04_quantization.json").write_text(json.dumps(results, indent=1, default=float))
print(f"headline numbers written to {RESULTS_DIR / '04_quantization.json'}: {', '.join(results)}")

# %% [markdown]
# ## What we found
#
# Rendered from this run's numbers: the cell below reads what the cells above computed.

# %%
from IPython.display import Markdown


def model_line(name):
    """One model's table in a sentence: every scheme's perplexity change against float."""
    t = {r["scheme"]: r for r in tables[name]}
    return f"**{name}**: " + ", ".join(f"{k} {t[k]['delta_vs_float_pct']:+.1f}%" for k in t if k != "float")


by = {r["scheme"]: r for r in rows}
d = {k: r["delta_vs_float_pct"] for k, r in by.items()}
unpruned = prune_rows[0][1] / by["float"]["perplexity"] - 1
same_ppl = len({round(v, 9) for *_, v in cov_rows}) == 1
c = by["w8a8c-shadow"]
Markdown(f"""Measured on {model.name}, {WINDOWS} held-out windows of {WINDOW} tokens, clips from {CALIB:,} calibration
tokens.

- **Plain per-tensor W8A8** multiplies perplexity by {by["w8a8"]["perplexity"] / by["float"]["perplexity"]:.1f} and
  agrees with float's top-1 token {by["w8a8"]["top1_agreement"]:.0%} of the time (mllm-NPU Table 5: SmoothQuant's
  per-tensor W8A8 loses 5–15 %).
- **W8A8 with shadow outliers** costs {d["w8a8-shadow"]:+.1f}% at the paper's 85 % prune rate and
  {100 * unpruned:+.1f}% with no pruning (paper: within ≈1 %); the worst layer's linears lose
  {100 * err["w8a8-shadow"].max():.1f}% of their output against {100 * err["w8a8"].max():.1f}% without the shadow.
  Per layer the SQNR spans {sqnr["w8a8"].min():.1f}–{sqnr["w8a8"].max():.1f} dB without the shadow (worst: layer
  {int(np.argmin(sqnr["w8a8"]))}) and {sqnr["w8a8-shadow"].min():.1f}–{sqnr["w8a8-shadow"].max():.1f} dB with it.
- **LLM.int8()** (outlier columns in float, vector-wise int8): {d["llm-int8"]:+.1f}%, at the price of dynamic per-token
  scales an NPU does not offer.
- **Q4_0** {d["q4_0"]:+.1f}% and **tile-group Q4_0** {d["q4_0-tile"]:+.1f}% (the checkpoint is already 4-bit, so a
  second 4-bit grid stacks two rounding errors).
- **The prune rate** trades accuracy for CPU work: perplexity """ + " → ".join(
    f"{v:.2f}" for _, v, _ in prune_rows) + f""" from prune rate {prune_rows[0][0]} to {prune_rows[-1][0]}.
  **Coverage** moves shadow rows from flash ({cov_rows[0][2] / 1e3:.0f} kB read at coverage {cov_rows[0][0]}) to
  memory ({cov_rows[-1][1] / 1e6:.2f} MB resident at {cov_rows[-1][0]}) with perplexity
  {"unchanged" if same_ppl else "changing (it should not: the arithmetic is the same)"}.
- **Per-channel weight scales** (`w8a8c-shadow`, p99.1 clips, every layer's shadow kept):
  {c["delta_vs_float_pct"]:+.2f}%, top-1 {c["top1_agreement"]:.1%}, {c["channels_in_float_pct"]:.2f}% of activation
  values in float, against {d["w8a8-shadow"]:+.1f}% for the paper's per-tensor variant: what HTP offers (int8 weights
  with a scale per output channel) {"closes most of the gap" if c["delta_vs_float_pct"] < 0.5 * d["w8a8-shadow"]
                                     else "narrows the gap" if c["delta_vs_float_pct"] < d["w8a8-shadow"]
                                     else "does not close the gap here"}.
- Every model on the same windows: """ + "; ".join(model_line(n) for n in MODELS) + ".")
