# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · A phone's trace beside our prediction
#
# **Question.** Every phone number edgeprobe showed so far is an emulation on this CPU or a prediction from a cost
# model whose rates were set to reproduce one sentence of a paper. Researchers already hold real phone traces, recorded
# with llama.cpp's Hexagon profiler and exported as Chrome JSON. How much of such a trace maps onto our model template,
# what cost model does the phone's own trace give (HeteroLLM §4's "predicted" mode, fitted from data), how well does it
# predict layers it was not fitted on, and what does it predict for the out-of-order chunked prefill on that phone?
#
# The trace is a real excerpt bundled with the tests (`tests/data/foreign/chrome_json`, quoted from a public
# repository, its SOURCE.md says which): LFM2-1.2B-Q4_0 on llama.cpp's ggml-hexagon backend, Snapdragon 8 Elite
# (SM8750, Hexagon v79), `GGML_HEXAGON_PROFILE=2`, the first three layers of one forward pass over 2 tokens.

# %%
import json
import os
import pathlib

import plotly.graph_objects as go

import edgeprobe
from edgeprobe.foreign.align import align
from edgeprobe.foreign.fit import fit
from edgeprobe.models import ModelConfig
from edgeprobe.schedule.cost import cost_model
from edgeprobe.schedule.predict import predicted_schedule
from edgeprobe.trace import Trace

DATA = pathlib.Path(edgeprobe.__file__).resolve().parents[1] / "tests" / "data" / "foreign" / "chrome_json"
FIXTURE = DATA / "lfm2_hexagon_v79.json"
# LFM2-1.2B is not shipped: its template needs shapes only, so the numbers its source document gives (SOURCE.md)
# are the config (align() also takes an HF config.json, an HF folder or a GGUF)
LFM2 = dict(arch="lfm2", n_layers=16, hidden=2048, ffn=8192, n_heads=32, n_kv_heads=8, head_dim=64,
            vocab_size=65536, qk_norm=True)
PROMPT, CHUNK = 256, 64   # the chunked prefill predicted at the end
measured = Trace.load_foreign(FIXTURE)
src = measured.meta["source"]
print(f"read {len(measured.events)} events from {FIXTURE.name} ({src['tool']}; format {src['format']}), "
      f"{measured.meta['skipped_events']} counter events skipped; lanes {measured.lanes}")
print("times:", measured.meta["time"]["unit"], "|", measured.meta["time"]["cycles"])
measured.figure("the phone's measured timeline: LFM2-1.2B on Hexagon v79 (ops end to end, as exported)")

# %% [markdown]
# ## Align it to the model template, op by op
#
# Each event is matched to template ops by op type, the tensor names it carries (`ffn_gate`, `Qcur-2`), its layer and
# the weight's shape. What maps nowhere stays in the trace, tagged with why: LFM2's gated short-convolution layers
# (`SSM_CONV`, its `CONCAT`/`CPY` state updates) have no op in our template, which models attention layers only.

# %%
a = align(measured, LFM2)
tokens = a.trace.meta["aligned_to"]["tokens"]
unmatched = {k: v for k, v in a.by_kind.items() if v["unmatched_us"] > 0}
print(f"{a.share:.1%} of the measured time ({a.matched_us:.0f} of {a.total_us:.0f} us) maps to template ops "
      f"(template over {tokens} tokens, from the first matmul's activation rows)")
for kind, v in sorted(unmatched.items(), key=lambda kv: -kv[1]["unmatched_us"]):
    why = next(e["unmatched"] for e in a.trace.events if e["kind"] == kind and "unmatched" in e)
    print(f"  unmatched {kind:10s} {v['unmatched_us']:5.0f} us in {v['events']} events: {why}")
kinds = sorted(a.by_kind, key=lambda k: -(a.by_kind[k]["matched_us"] + a.by_kind[k]["unmatched_us"]))
go.Figure([go.Bar(name=side, x=kinds, y=[a.by_kind[k][f"{side}_us"] for k in kinds]) for side in ("matched",
                                                                                                    "unmatched")]
          ).update_layout(barmode="stack", title=f"measured time by op type: {a.share:.0%} aligned to the template",
                          yaxis_title="µs in the excerpt")

# %% [markdown]
# ## Fit the phone's cost model, and check it on a layer it did not see
#
# Per lane and cost kind: µs = fixed + FLOPs / rate + weight bytes / bandwidth, by non-negative least squares over the
# aligned ops; where an op's token rows M cross a kernel change, the rows below a threshold get their own coefficients.
# This trace has one M (2 rows), so bytes are proportional to FLOPs and one regime is fitted, priced by FLOPs: the
# `regime` line says so. The held-out error fits on layers 0 and 2 and predicts layer 1; the saved model is then
# fitted on all three.

# %%
phone = fit(a, name="lfm2-sm8750")
h = phone.held_out
print(f"held out ({h['split']}): median error {h['median_rel_error']:.1%}, time-weighted "
      f"{h['time_weighted_rel_error']:.1%}, worst {h['max_rel_error']:.0%} over {h['n_predicted']} ops")
for lane, fits in phone.fits.items():
    for kind, f in fits.items():
        rate = f"{f['rate_gflops']:8.2f} GFLOP/s" if f["rate_gflops"] else "no FLOP term"
        bw = f" + {f['bandwidth_gbs']:.1f} GB/s" if f["bandwidth_gbs"] else ""
        print(f"  {lane}/{kind:11s} fixed {f['fixed_us']:6.1f} us + {rate}{bw} ({f['n']} ops, {f['sizes']} sizes, "
              f"FLOPs {f['flops_range'][0]:.3g}..{f['flops_range'][1]:.3g}; regime {f['regime']})")
RESULTS_DIR = pathlib.Path(os.environ.get("EDGEPROBE_NB_RESULTS", "out"))
RESULTS_DIR.mkdir(parents=True, exist_ok=True)
phone.to_json(RESULTS_DIR / "lfm2-sm8750.json")   # `edgeprobe schedule --cost-model` takes this file

# %% [markdown]
# ## Measured over predicted, op for op
#
# Each aligned event beside the fitted model's time for the same template ops (in-sample: the fit saw these ops).

# %%
op = {o["name"]: o for o in a.ops}
meas_ev, pred_ev, t = [], [], 0.0
for e in (e for e in a.trace.events if e.get("template_ops")):
    key = "+".join(e["template_ops"])
    d = sum(phone.op_time_us(op[n], e["lane"]) for n in e["template_ops"])
    meas_ev.append({**e, "group": key})
    pred_ev.append({"name": key, "kind": e["kind"], "lane": e["lane"], "layer": e["layer"], "chunk": 0, "group": key,
                    "start_us": t, "end_us": t + d, "predicted": True})
    t += d
meas_ops = Trace(meas_ev, {**a.trace.meta, "title": "measured (Hexagon v79)"})
pred_ops = Trace(pred_ev, {"title": "predicted: lfm2-sm8750 (fitted)", "predicted": True, "modelled": False})
fig, rows = meas_ops.compare(pred_ops, "LFM2-1.2B on Hexagon v79: measured (top) over predicted by the fitted model")
fig

# %%
scatter, _ = meas_ops.prediction_scatter(pred_ops, "fitted model vs the phone, per aligned op")
scatter

# %% [markdown]
# ## The out-of-order chunked prefill on that phone
#
# mllm-NPU's chunked prefill (§3.2) scheduled in order and out of order (§3.4), priced by the fitted model for the
# NPU lane (CPU attention stays on the named profile: the trace has no CPU op). LFM2-1.2B is known here by its
# configuration only: `predicted_schedule` plans it with float stand-in records (the alignment's template, whose weight
# bytes the fit saw; llama.cpp's Q4_0 has no shadow GEMMs) and prices the fitted lane op by op. The trace's matmuls
# had 2 activation rows; a chunk has many more, so the fitted rates are extrapolated far beyond the FLOPs they saw.

# %%
named = cost_model("snapdragon-8gen3")
plans = {}
for m in (phone, named):
    for s in ("in-order", "ooo"):
        graph, plans[(m.name, s)] = predicted_schedule(ModelConfig(**LFM2), PROMPT, CHUNK, s, m, scheme="float")
for (name, s), p in plans.items():
    print(f"{name:17s} {s:8s} makespan {p.makespan_us / 1e3:7.1f} ms, busy "
          + ", ".join(f"{lane} {b:.0f}%" for lane, b in p.busy().items()))
lin = phone.fits["npu"]["linear"]
chunk_flops = max(fl for sg in graph.subgraphs if sg.lane == "npu" for k, fl in sg.costs if k.endswith("linear"))
extrapolation = chunk_flops / lin["flops_range"][1]
print(f"a chunk's largest matmul has {extrapolation:.0f}x the FLOPs of the largest the fit saw")
ooo = plans[(phone.name, "ooo")]
ooo.to_trace().figure(f"predicted out-of-order chunked prefill on the phone: {PROMPT} tokens in chunks of {CHUNK}")

# %%
results = {"fixture": FIXTURE.name, "source": src, "events": len(measured.events),
           "skipped_events": measured.meta["skipped_events"], "tokens": tokens, "aligned_share": a.share,
           "aligned_us": a.matched_us, "total_us": a.total_us, "held_out": h, "fits": phone.fits,
           "compare_rows": rows, "prompt": PROMPT, "chunk": CHUNK, "extrapolation": extrapolation,
           "makespan_ms": {f"{n}/{s}": p.makespan_us / 1e3 for (n, s), p in plans.items()}}
(RESULTS_DIR / "08_phone_trace.json").write_text(json.dumps(results, indent=1, default=float))
print(f"headline numbers written to {RESULTS_DIR / '08_phone_trace.json'}: {', '.join(results)}")

# %% [markdown]
# ## What we found
#
# Rendered from this run's numbers: the cell below reads what the cells above computed.

# %%
from IPython.display import Markdown

mk = results["makespan_ms"]
Markdown(f"""Measured on a real phone (Snapdragon 8 Elite, Hexagon v79), quoted from a public trace; predicted here.

- **Imported**: {len(measured.events)} measured ops of LFM2-1.2B's first three layers over {tokens} tokens
  ({a.total_us:.0f} µs). **{a.share:.1%} of the measured time** maps to template ops; the rest is LFM2's
  short-convolution machinery and bookkeeping the template does not model ({", ".join(sorted(unmatched))}).
- **Fitted cost model**: matmuls at {lin["rate_gflops"]:.0f} GFLOP/s plus {lin["fixed_us"]:.0f} µs per op on the
  NPU lane (the named profile assumes {named.rate("npu", "int8_linear"):.0f}). Fitted on two layers, it predicts the
  third with a **median error of {h["median_rel_error"]:.0%}** per op ({h["time_weighted_rel_error"]:.0%} weighted
  by time, worst {h["max_rel_error"]:.0%}).
- **Chunked prefill on that phone** ({PROMPT} tokens, chunks of {CHUNK}): out of order
  {mk[f"{phone.name}/ooo"]:.0f} ms against in order {mk[f"{phone.name}/in-order"]:.0f} ms with the fitted model;
  the named profile predicts {mk[f"{named.name}/ooo"]:.0f} ms. The trace's matmuls had {tokens} rows, so a chunk's
  matmul is {extrapolation:.0f}× beyond what the fit saw: a trace of a longer prompt on that phone would pin it.""")
