# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Plan a phone you do not have
#
# **Question.** A researcher holds a model's `config.json` and a paper's claim ("more than 1,000 tok/s of prefill",
# "51 tok/s of decode"), and no phone. What should a Snapdragon 8 Gen 3 give for an 8B model, prefill and decode,
# run the way each paper runs it — mllm-NPU's chunked NPU + CPU prefill, HeteroLLM's GPU + NPU row cuts, one
# processor alone? What does batch-N decode buy on the NPU (the test-time-scaling paper's argument), what does
# HeteroLLM's decode split buy, what do experts read from flash cost (EdgeMoE)? And how far are these predictions
# from the papers' own phone numbers?
#
# Everything here is predicted from configs alone (`tests/data/configs/`, each with its source) on the SoC's
# roofline (`toolkit/schedule/soc/snapdragon-8gen3.json`): each op costs max(FLOPs / rate of its dtype, bytes /
# bandwidth) plus its dispatch, launch and sync, every number from a paper's component measurement or a vendor
# specification (`docs/predict.md`). Nothing runs on a device, so nothing here depends on this machine.

# %%
import json
import os
import pathlib

import plotly.graph_objects as go

import edgeprobe
from edgeprobe.schedule import papers, soc
from edgeprobe.schedule.predict import predict

CONFIGS = pathlib.Path(edgeprobe.__file__).resolve().parents[1] / "tests" / "data" / "configs"
SOC = "snapdragon-8gen3"
MODEL = CONFIGS / "llama-3-8b" / "config.json"  # HeteroLLM's "Llama-8B"
PROMPT, DECODE = 256, 64
phone = soc.load(SOC)
print(f"{phone.soc}: lanes {', '.join(phone.lanes)}; bandwidth alone "
      + ", ".join(f"{n} {l.bandwidth_gbs:g} GB/s" for n, l in phone.lanes.items())
      + f", together {phone.together_gbs:g} GB/s; flash {phone.flash_gbs:g} GB/s")
for key in ("lanes.npu.compute.int8", "lanes.npu.compute.fp16", "together_bandwidth"):
    print(f"  {key} = {phone.sources[key]['text']}: {phone.sources[key]['source']}")

# %% [markdown]
# ## An 8B model, each paper's way
#
# mllm-NPU runs W8A8 per tensor with shadow outliers (`w8a8-shadow`) and decodes on the CPU; HeteroLLM, the TTS
# paper and llama.cpp run W4A16 (`q4_0`: 4.5 bits a weight, FP16 compute on the GPU and NPU).

# %%
WAYS = [("mllm-npu", "w8a8-shadow"), ("hetero", "q4_0"), ("gpu", "q4_0"), ("npu", "q4_0"), ("cpu", "q4_0")]
ways = {s: predict(MODEL, SOC, PROMPT, DECODE, scheme=sc, strategy=s) for s, sc in WAYS}
print(f"{'strategy':<10} {'scheme':<12} {'prefill tok/s':>13} {'bound':>10}   {'decode tok/s':>12} {'bound':>10}")
for s, p in ways.items():
    print(f"{s:<10} {p.scheme:<12} {p.prefill_tok_s:>13.1f} {p.prefill.bound:>10}   {p.decode_tok_s:>12.2f} "
          f"{p.decode_step.bound:>10}")
fig = go.Figure()
fig.add_bar(x=list(ways), y=[p.prefill_tok_s for p in ways.values()], name="prefill (tok/s)")
fig.add_bar(x=list(ways), y=[p.decode_tok_s for p in ways.values()], name="decode (tok/s)")
fig.add_scatter(x=["hetero", "hetero"], y=[236.92, 14.01], mode="markers", marker=dict(symbol="diamond", size=12),
                name="HeteroLLM §5.3-5.4, measured (Llama-8B, 256 tokens)")
fig.update_layout(title=f"Llama-3-8B on {phone.soc}, {PROMPT}-token prompt, predicted", barmode="group",
                  yaxis=dict(type="log", title="tokens / s"), xaxis_title="strategy")
fig

# %% [markdown]
# ## Batch-N decode on the NPU (test-time scaling)
#
# The NPU's matrix unit computes 32 rows at a time: a decode step of one sequence fills one of them. Decoding N
# candidates together (Best-of-N, beams) fills more of the same tiles, so the step grows only with the KV cache and
# the logits, which the TTS paper computes on the CPU.

# %%
SMALL = CONFIGS / "llama-3.2-1b" / "config.json"
BATCHES = (1, 2, 4, 8, 16)
batched = {b: predict(SMALL, SOC, 512, 128, batch=b, scheme="q4_0-tile", strategy="npu") for b in BATCHES}
def lane_ms(p, lane):
    """ms of a predicted decode step on one lane."""
    return sum(e["end_us"] - e["start_us"] for e in p.decode_step.trace.events if e["lane"] == lane) / 1e3



fig = go.Figure()
fig.add_bar(x=[str(b) for b in BATCHES], y=[lane_ms(p, "npu") for p in batched.values()], name="NPU (HMX, HVX)")
fig.add_bar(x=[str(b) for b in BATCHES], y=[lane_ms(p, "cpu") for p in batched.values()], name="CPU (logits)")
fig.add_scatter(x=[str(b) for b in BATCHES], y=[p.decode_tok_s_batch for p in batched.values()], yaxis="y2",
                name="tokens / s of the batch", mode="lines+markers")
fig.update_layout(title="Llama-3.2-1B decode step on the NPU against the batch (predicted)", barmode="stack",
                  xaxis_title="sequences decoded together", yaxis_title="ms a step",
                  yaxis2=dict(overlaying="y", side="right", title="tok/s (batch)"))
for b, p in batched.items():
    print(f"batch {b:>2}: {p.decode_step.ms:6.2f} ms a step, {p.decode_tok_s_batch:7.1f} tok/s for the batch "
          f"(NPU {lane_ms(p, 'npu'):.2f} ms, CPU logits {lane_ms(p, 'cpu'):.2f} ms)")
fig

# %% [markdown]
# ## HeteroLLM's decode split
#
# Decode streams every weight once a token: one processor reaches 40-45 GB/s, GPU and NPU together 59.1
# (HeteroLLM §5.3). Cutting each weight's rows between them uses both processors' bandwidth.

# %%
MEASURED = {"llama-3-8b": 14.01, "llama-3.2-3b": 29.9, "internlm2-1.8b": 51.12}  # HeteroLLM §5.3, tok/s
split = {m: {s: predict(CONFIGS / m / "config.json", SOC, 256, 64, scheme="q4_0", strategy=s).decode_tok_s
             for s in ("gpu", "hetero")} for m in MEASURED}
fig = go.Figure()
fig.add_bar(x=list(MEASURED), y=[split[m]["gpu"] for m in MEASURED], name="GPU alone (predicted)")
fig.add_bar(x=list(MEASURED), y=[split[m]["hetero"] for m in MEASURED], name="GPU + NPU rows cut (predicted)")
fig.add_scatter(x=list(MEASURED), y=list(MEASURED.values()), mode="markers", marker=dict(symbol="diamond", size=12),
                name="HeteroLLM, measured")
fig.update_layout(title="Decode on Snapdragon 8 Gen 3: one processor's bandwidth against two", barmode="group",
                  yaxis_title="tokens / s")
for m in MEASURED:
    gain = split[m]["hetero"] / split[m]["gpu"]
    print(f"{m}: GPU {split[m]['gpu']:.1f}, GPU + NPU {split[m]['hetero']:.1f} tok/s (x{gain:.2f}); "
          f"HeteroLLM measured {MEASURED[m]}")
fig

# %% [markdown]
# ## Experts from flash (EdgeMoE)
#
# A mixture of experts keeps its experts in flash and a buffer of them in memory: each step reads the routed experts
# the buffer misses at the flash's bandwidth. The hit rate is an expert profile's (`edgeprobe profile experts`,
# notebook 02); here it is swept.

# %%
MOE = CONFIGS / "qwen3-30b-a3b" / "config.json"
HITS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)
moe = {h: predict(MOE, SOC, 64, 16, scheme="moe-mixed", strategy="cpu", experts_in_flash=True, expert_hit_rate=h)
       for h in HITS}
fig = go.Figure(go.Scatter(x=list(HITS), y=[p.decode_tok_s for p in moe.values()], mode="lines+markers"))
fig.update_layout(title="Qwen3-30B-A3B decode with its experts in flash (INT4, CPU), predicted",
                  xaxis_title="expert buffer hit rate", yaxis_title="tokens / s")
for h, p in moe.items():
    print(f"hit rate {h:.2f}: {p.decode_tok_s:.2f} tok/s, bound by {p.decode_step.bound} ({p.decode_step.shares})")
fig

# %% [markdown]
# ## Against the papers' own phone numbers
#
# Every end-to-end phone result of the five papers that states an absolute number (`tests/data/papers/`), predicted
# from its model's config in the setting it was measured in.

# %%
rows = papers.check()
summary = papers.summary(rows)
pred = [r for r in rows if "error" in r]
lo, hi = min(min(r["value"], r["predicted"]) for r in pred), max(max(r["value"], r["predicted"]) for r in pred)
fig = go.Figure()
fig.add_scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="predicted = paper", line=dict(dash="dash", color="#444"))
fig.add_scatter(x=[lo, hi], y=[lo / 2, hi / 2], mode="lines", name="2x off", line=dict(dash="dot", color="#999"))
fig.add_scatter(x=[r["value"] for r in pred], y=[r["predicted"] for r in pred], mode="markers+text",
                text=[r["id"].replace("heterollm-", "H ").replace("mllm-npu-", "M ") for r in pred],
                textposition="top center", name="rows")
fig.update_layout(title=f"edgeprobe against the papers: median |error| {summary['median_abs_error']:.0%}",
                  xaxis=dict(type="log", title="the paper (tok/s)"), yaxis=dict(type="log", title="edgeprobe (tok/s)"))
for r in rows:
    got = (f"predicted {r['predicted']:.1f} ({r['error']:+.0%})" if "error" in r else f"not predicted: {r['why']}")
    print(f"{r['id']:<50} paper {r['value']:>8.2f}  {got}")
fig

# %%
RESULTS_DIR = pathlib.Path(os.environ.get("EDGEPROBE_NB_RESULTS", "out"))
RESULTS_DIR.mkdir(parents=True, exist_ok=True)
results = {"soc": SOC, "model": MODEL.parent.name, "prompt": PROMPT, "decode": DECODE,
           "ways": {s: p.to_json() for s, p in ways.items()},
           "batched": {str(b): p.decode_tok_s_batch for b, p in batched.items()},
           "split": split, "moe": {str(h): p.decode_tok_s for h, p in moe.items()}, "summary": summary}
(RESULTS_DIR / "09_plan_a_phone.json").write_text(json.dumps(results, indent=1, default=float))

# %% [markdown]
# ## What we found
#
# Rendered from this run's numbers: the cell below reads what the cells above computed.

# %%
from IPython.display import Markdown

w, b1, b16 = ways, batched[1], batched[16]
fast = max(w, key=lambda s: w[s].prefill_tok_s)
not_bw = [s for s in w if w[s].decode_step.bound != "bandwidth"]
others = (f"every way but {', '.join(not_bw)} ({', '.join(w[s].decode_step.bound for s in not_bw)}-bound: the NPU "
          "pads a decode step's one row to its 32-row tiles)" if not_bw else "every way")
below = all(r["error"] < 0 for r in pred)
Markdown(f"""Predicted for {phone.soc} from configs alone; every parameter from a component measurement or a
specification.

- **Llama-3-8B, {PROMPT}-token prompt**: prefill is fastest with **{fast}** ({w[fast].prefill_tok_s:.0f} tok/s,
  {w[fast].prefill.bound}-bound); mllm-NPU's way gives {w["mllm-npu"].prefill_tok_s:.0f}, HeteroLLM's
  {w["hetero"].prefill_tok_s:.0f} (it measured 236.92). Decode is bandwidth-bound in {others}; HeteroLLM's split
  gives {w["hetero"].decode_tok_s:.1f} tok/s (measured 14.01), the GPU alone {w["gpu"].decode_tok_s:.1f}, the CPU
  {w["cpu"].decode_tok_s:.1f}.
- **Batch-N decode on the NPU** (Llama-3.2-1B): 16 sequences take {b16.decode_step.ms / b1.decode_step.ms:.1f}x one
  sequence's step and give {b16.decode_tok_s_batch / b1.decode_tok_s_batch:.1f}x its tokens; the CPU's logits grow
  from {lane_ms(b1, "cpu"):.1f} to {lane_ms(b16, "cpu"):.1f} ms a step, the NPU's share only from
  {lane_ms(b1, "npu"):.1f} to {lane_ms(b16, "npu"):.1f} ms.
- **HeteroLLM's split** decodes {min(split[m]["hetero"] / split[m]["gpu"] for m in split):.2f}-
  {max(split[m]["hetero"] / split[m]["gpu"] for m in split):.2f}x faster than the GPU alone: the ratio of the two
  bandwidths it measured (59.1 / 43.3 = 1.36), less the syncs.
- **Experts from flash**: Qwen3-30B-A3B decodes at {moe[0.0].decode_tok_s:.2f} tok/s with every expert read from
  flash and {moe[1.0].decode_tok_s:.2f} with all of them buffered; at a 90% hit rate, {moe[0.9].decode_tok_s:.2f}.
- **Against the papers**: {summary["predicted"]} of {summary["rows"]} rows predicted, median |error|
  **{summary["median_abs_error"]:.0%}**, worst {summary["worst_abs_error"]:.0%} ({summary["worst"]}); {"every"
  if below else "not every"} prediction is below the paper{", so this phone model is conservative" if below else ""};
  the rows it cannot predict say why.""")
