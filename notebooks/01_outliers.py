# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Where are SmolLM2's activation outliers?
#
# **Question.** If SmolLM2-135M ran per-tensor W8A8 on a phone NPU, which activation values would fall
# outside the int8 range, in how many channels, and which layers would actually need the float "shadow"
# execution that mllm-NPU (§3.3) runs on the CPU?
#
# mllm-NPU reports on Qwen1.5-1.8B / LLaMA-2-7B: outliers touch only **0.1–0.3 % of channels** per layer
# (about 5–15; Fig. 10); **fewer than 3 % of channels produce over 80 %** of the outliers (Fig. 11); and the
# outliers of the **85 % least important layers** can be pruned, importance being max outlier / scale, with
# layers near the input and output mattering most (Fig. 12).
#
# **Rule used here.** Each linear input (attn_in, attn_out, ffn_in, ffn_act) gets a per-tensor clip value
# c = the 99.99th percentile of |x| on calibration tokens (int8 scale s = c/127); |x| > c is an outlier.
# LLM.int8()'s fixed threshold 6.0 is kept as a second view. One inference = one 512-token window.

# %%
import os

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
      f"{100 * s['outlier_fraction_of_values']:.4f}% of all activation values are outliers")

# %% [markdown]
# ## Fig. 10 — outlier channels per layer

# %%
stats.figure("channels")

# %%
print(f"ours : {s['fig10_outlier_channels_per_window_mean']:.1f} channels per window on average "
      f"= {s['fig10_outlier_channels_pct_mean']:.2f}% of channels "
      f"(worst layer {s['fig10_outlier_channels_pct_max_layer']:.2f}%); "
      f"{s['fig10_outlier_channels_per_token_mean']:.3f} per token")
print("paper: 5-15 channels, 0.1-0.3% of channels (Qwen1.5-1.8B, 2048-token inference)")

# %% [markdown]
# ## Fig. 11 — a few channels produce most outliers

# %%
stats.figure("share")

# %%
print(f"ours : {s['fig11_pct_channels_for_80pct_outliers']:.2f}% of channels produce 80% of outliers "
      f"(LLM.int8() threshold 6.0: {s['fig11_pct_channels_for_80pct_outliers_llm_int8']:.2f}%)")
print(f"       hot channels for 80% coverage per tensor: {s['hot_channels']} = "
      f"{s['hot_channels_pct']:.2f}% of all channels")
print("paper: < 3% of channels produce > 80% of outliers")

# %% [markdown]
# ## Fig. 12 — which layers' outliers matter

# %%
stats.figure("importance")

# %%
print("kept layers (15% most important):", s["kept_layers"])
print("paper: layers near the input and the output are the most important")

# %% [markdown]
# ## Where |x| sits relative to the clip

# %%
stats.figure("histogram")

# %%
from edgeprobe.profile import OutlierStats

stats.save("out/notebook_outliers.npz")
assert OutlierStats.load("out/notebook_outliers.npz") == stats

# %%
# the headline numbers as data (tests/test_notebooks.py checks them)
import json
import pathlib

RESULTS_DIR = pathlib.Path(os.environ.get("EDGEPROBE_NB_RESULTS", "out"))
RESULTS_DIR.mkdir(parents=True, exist_ok=True)
present = [n for n in stats.names if n in stats.arrays]
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
           "kept_layers": s["kept_layers"], "profile": str(pathlib.Path("out/notebook_outliers.npz").resolve())}
(RESULTS_DIR / "01_outliers.json").write_text(json.dumps(results, indent=1, default=float))
print(f"headline numbers written to {RESULTS_DIR / '01_outliers.json'}: {', '.join(results)}")

# %% [markdown]
# ## What we found
#
# Rendered from this run's numbers (the cell below reads what the cells above computed).

# %%
import numpy as np
from IPython.display import Markdown

imp = stats.layer_importance()
L, wide = model.config.n_layers, (model.config.hidden, model.config.ffn)
per_window, pct, pct_worst = (s[f"fig10_outlier_channels_{k}"]
                              for k in ("per_window_mean", "pct_mean", "pct_max_layer"))
p80, p80_int8 = s["fig11_pct_channels_for_80pct_outliers"], s["fig11_pct_channels_for_80pct_outliers_llm_int8"]
kept = sorted(s["kept_layers"])
edge = [i for i in kept if i < 3 or i >= L - 3]  # "near the input and the output": the first or last three layers
massive = int(np.argmax(imp))
Markdown(f"""Measured on {model.name} with {s["tokens"]:,} tokens of the bundled corpus in {s["windows"]} windows of
{WINDOW} tokens; {100 * s["outlier_fraction_of_values"]:.4f}% of all activation values lie above their clip.

- **Fig. 10 — outlier channels.** {per_window:.1f} channels per layer carry an outlier in a {WINDOW}-token inference
  ({"within" if 5 <= per_window <= 15 else "outside"} the paper's 5–15), which is {pct:.2f}% of channels on average
  and {pct_worst:.2f}% in the worst layer: {"as in" if 0.1 <= pct <= 0.3 else "not"} the paper's 0.1–0.3 %, the
  layers being {wide[0]} / {wide[1]} channels wide.
- **Fig. 11 — concentration.** {p80:.2f}% of channels produce 80 % of the outliers (paper: < 3 %:
  {"agrees" if p80 < 3 else "disagrees"}); with LLM.int8()'s fixed threshold 6.0, {p80_int8:.2f}%. The fewer the
  channels, the more a hot-channel weight cache pays.
- **Fig. 12 — importance.** The {len(kept)} layers kept (15 % most important by max |x| / clip) are {kept}; {len(edge)}
  of them lie among the first or last three layers (the paper: layers near the input and the output matter most).
  The largest outlier is in layer {massive}, at {imp[massive]:.0f}× its clip: the measured ranking, not position,
  decides what is pruned.
- Stats are values: `stats.merge(other)`, `stats.save(path)`, `OutlierStats.load(path)`, and
  `stats.smoothquant_scales()` feeds the quantizers.""")
