# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · How should a chunked prefill be cut and ordered across processors?
#
# **Question.** mllm-NPU cuts a prompt into fixed chunks so that the NPU's static graphs can be *shared* by all
# chunks (§3.2), then runs subgraphs out of order to fill the bubbles between NPU and CPU (§3.4). HeteroLLM
# instead partitions each matmul between GPU and NPU (§4). How much do these choices buy — predicted on a
# modelled phone, and measured on our agent?
#
# Paper numbers: chunk-shared graphs save **up to 75%** memory (Qwen1.5-1.8B, prompt 1024, chunk 256; 120 of 144
# subgraphs shared); in-order overlap leaves **37% bubbles**, out-of-order execution cuts prefill latency
# **18–44%**; HeteroLLM's solver beats padding by **up to 2.12×** at unaligned lengths and the multi-shape "pipe" by
# **13–30%**. Every modelled number below says *modelled*; the Snapdragon cost model is calibrated to mllm-NPU's own
# measurement (Qwen1.5-1.8B, 256 tokens: NPU 315 ms, CPU about half).

# %%
import dataclasses
import os

import numpy as np
import plotly.graph_objects as go

from edgeprobe import models
from edgeprobe.models import ModelConfig
from edgeprobe.schedule import chunk_graph, cost_model, schedule
from edgeprobe.schedule.hetero import compare_strategies

PROMPT = int(os.environ.get("EDGEPROBE_NB_PROMPT", 1024))   # the test suite runs the agent part small
QWEN = ModelConfig(arch="llama", n_layers=24, hidden=2048, ffn=5504, n_heads=16, n_kv_heads=16, head_dim=128,
                   vocab_size=151936, context_length=32768, tie_embeddings=False, name="Qwen1.5-1.8B")
smollm = models.load("smollm2-135m")
sd = cost_model("snapdragon-8gen3")
print(sd.source)

# %% [markdown]
# ## §3.2 — chunk-shared graphs: memory

# %%
mem_rows = []
for name, cfg in (("Qwen1.5-1.8B", QWEN), ("SmolLM2-135M", smollm.config)):
    m = chunk_graph(cfg, 1024, 256).memory()
    mem_rows.append((name, m))
    print(f"ours ({name}, 1024 / 256): per-chunk graphs {m['chunk_graphs_bytes'] / 1e6:,.0f} MB, chunk-shared "
          f"{m['chunk_shared_bytes'] / 1e6:,.0f} MB: {100 * m['saving']:.0f}% saved; {m['shared_subgraphs']} of "
          f"{m['subgraphs_per_chunk']} subgraphs per chunk shared")
print("paper: up to 75% saved (Qwen1.5-1.8B), 120 of 144 subgraphs shared")
go.Figure([go.Bar(x=[n for n, _ in mem_rows], y=[m["chunk_graphs_bytes"] / 1e6 for _, m in mem_rows],
                  name="a graph per chunk"),
           go.Bar(x=[n for n, _ in mem_rows], y=[m["chunk_shared_bytes"] / 1e6 for _, m in mem_rows],
                  name="chunk-shared graphs")]
          ).update_layout(title="Pre-built graph memory at prompt 1024, chunk 256 (weights + buffers, modelled)",
                          yaxis_title="MB", barmode="group")

# %% [markdown]
# ## §3.4 — in-order against out-of-order (modelled Snapdragon 8 Gen 3, Qwen1.5-1.8B)

# %%
g = chunk_graph(QWEN, 1024, 256)
ino, ooo = schedule(g, sd, "in-order"), schedule(g, sd, "ooo")
print(f"ours (modelled): in-order {ino.makespan_us / 1e3:.0f} ms, out-of-order {ooo.makespan_us / 1e3:.0f} ms = "
      f"{ooo.makespan_us / ino.makespan_us:.2f}x; NPU busy {ino.busy()['npu']:.0f}% -> {ooo.busy()['npu']:.0f}%; "
      f"{ooo.decision_us:.1f} µs per decision")
print("paper: out-of-order cuts prefill latency 18-44% (0.56-0.82x); decisions take microseconds")
ooo.to_trace().figure("out-of-order schedule, Qwen1.5-1.8B 1024 / 256 (modelled)")

# %%
ino.to_trace().figure("in-order schedule, Qwen1.5-1.8B 1024 / 256 (modelled)")

# %% [markdown]
# ### How far is the heuristic from the optimum? (small instances, exact branch and bound)

# %%
gaps = []
for prompt in (256, 512, 768):
    gs = chunk_graph(dataclasses.replace(QWEN, n_layers=1), prompt, 256)
    opt = schedule(gs, sd, "exact")
    h = schedule(gs, sd, "ooo")
    gaps.append((prompt, len(gs.subgraphs), h.makespan_us / opt.makespan_us - 1))
    print(f"1 layer, prompt {prompt}: {len(gs.subgraphs)} subgraphs, ooo {h.makespan_us / 1e3:.2f} ms vs optimum "
          f"{opt.makespan_us / 1e3:.2f} ms: gap {100 * gaps[-1][2]:.1f}%")
print("paper: the heuristic is not compared to an optimum (the problem is NP-hard); ours is, on small instances")

# %% [markdown]
# ## §4 — HeteroLLM's partition solver at unaligned prompt lengths (modelled)

# %%
res = {m: compare_strategies(QWEN, m) for m in (256, 300, 525, 1000)}
strategies = ["gpu", "npu-pad", "pipe", "seq-cut", "row-cut", "solver"]
fig = go.Figure([go.Bar(x=[str(m) for m in res], y=[res[m]["total_ms"][s] for m in res], name=s) for s in strategies])
fig.update_layout(title="Prefill matmul time of Qwen1.5-1.8B by partition strategy (modelled Snapdragon 8 Gen 3)",
                  xaxis_title="prompt length", yaxis_title="ms (all layers' linears)", barmode="group")
for m, r in res.items():
    print(f"ours {m:5d} tokens: solver {r['total_ms']['solver']:.0f} ms; vs padding {r['speedup_vs_padding']:.2f}x, "
          f"vs pipe {r['speedup_vs_pipe']:.2f}x; per matmul: "
          + ", ".join(sorted({c['strategy'] for c in r['choices'].values()})))
print("paper: up to 2.12x over padding at unaligned lengths; 13-30% over pipe")
fig

# %% [markdown]
# ## Measured on the agent: a cost model first (HeteroLLM's profiler), then in-order against out-of-order
#
# The schedulers decide by predicted times, so they are only as good as the cost model. We measure it on the agent:
# in-order chunked prefills over a grid of chunk lengths give every subgraph's busy time; HeteroLLM's *real* mode
# looks those up, its *predicted* mode fits `t = a + b·FLOPs` per lane and stage (any shape).

# %%
from edgeprobe import Device
from edgeprobe.corpus import read_corpus
from edgeprobe.prepare import prepared

CALIB = int(os.environ.get("EDGEPROBE_NB_CALIB", 4096))
CHUNK = max(16, PROMPT // 4)
# from the prepared-model cache the demo, the CLI and the API share: calibrated and quantized once
qm = prepared(smollm, "w8a8-shadow", say=print, calib_tokens=CALIB, calib_window=min(512, CALIB))
ids = smollm.tokenizer.encode(read_corpus("heldout"))
toks = ids[:PROMPT]
dev = Device.local()
cm = dev.measure_cost_model(qm, ids, chunks=(CHUNK // 4, CHUNK // 2, CHUNK), n_chunks=3)
err = cm.fit_error()
print(cm.source)
print("predicted-mode error on chunk lengths left out of the fit: "
      + ", ".join(f"{k} {100 * v['median']:.0f}%" for k, v in err.items() if k != "all"))
lanes = sorted(cm.fits)
fig = go.Figure()
for key in lanes:
    pts = [s for s in cm.samples if f"{s['lane']}/{s['stage']}" == key]
    fig.add_scatter(x=[s["flops"] / 1e6 for s in pts], y=[s["us"] / 1e3 for s in pts], mode="markers",
                    name=f"{key} measured")
    a, b = cm.fits[key]
    xs = np.linspace(0, max(s["flops"] for s in pts), 20)
    fig.add_scatter(x=xs / 1e6, y=(a + b * xs) / 1e3, mode="lines", name=f"{key} fit")
fig.update_layout(title="Subgraph time against FLOPs on the agent (npu lane emulated), with the fitted model",
                  xaxis_title="MFLOP", yaxis_title="ms")

# %%
dev.prefill_chunked(qm, toks, chunk=CHUNK, scheduler="in-order", cost_model=cm)     # warm
measured = {s: dev.prefill_chunked(qm, toks, chunk=CHUNK, scheduler=s, cost_model=cm) for s in ("in-order", "ooo")}
mk = {s: r.trace.metrics() for s, r in measured.items()}
print(f"ours (measured, {PROMPT} / {CHUNK}): in-order {mk['in-order']['makespan_ms']:.0f} ms, out-of-order "
      f"{mk['ooo']['makespan_ms']:.0f} ms = {mk['ooo']['makespan_ms'] / mk['in-order']['makespan_ms']:.2f}x; "
      f"npu busy {mk['in-order']['lanes']['npu']['busy_pct']:.0f}% -> {mk['ooo']['lanes']['npu']['busy_pct']:.0f}%")
print("paper: 0.56-0.82x; goal here <= 0.85x at 1024 tokens (bench/schedule.py measures it side by side)")
measured["ooo"].trace.figure("measured: out-of-order chunked prefill on the local agent")

# %%
fig, rows = measured["ooo"].trace.compare(measured["ooo"].schedule.to_trace(),
                                          "measured vs predicted (fitted cost model)")
err = np.array([r["error"] for r in rows])
print(f"{len(rows)} subgraphs: median per-subgraph prediction error {100 * np.median(np.abs(err)):.0f}%; makespan "
      f"predicted {measured['ooo'].schedule.makespan_us / 1e3:.0f} ms, measured {mk['ooo']['makespan_ms']:.0f} ms")
fig

# %% [markdown]
# ### Which chunk length? The predicted makespan against chunk length
#
# Short chunks pay more launches and cross-lane syncs; long ones leave fewer subgraphs to overlap (mllm-NPU §3.2
# picks 256). The prediction is the one `edgeprobe schedule` and `edgeprobe run --scheduler` make, over the cost
# model measured above, for the model the agent ran.

# %%
from edgeprobe.figures import makespan_figure, makespan_rows

sweep_chunks = sorted({max(1, PROMPT // d) for d in (16, 8, 4, 2, 1)})
by_chunk = makespan_rows(qm.manifest, PROMPT, sweep_chunks, ("in-order", "ooo"), cm)
best = {s_: min((r_ for r_ in by_chunk if r_["scheduler"] == s_), key=lambda r_: r_["makespan_ms"])
        for s_ in ("in-order", "ooo")}
for s_, r_ in best.items():
    print(f"{s_}: shortest predicted makespan {r_['makespan_ms']:.0f} ms at chunk {r_['chunk']} "
          f"(prompt {PROMPT}, {r_['subgraphs']} subgraphs)")
makespan_figure(by_chunk, f"Predicted prefill makespan against chunk length, SmolLM2 w8a8-shadow, prompt {PROMPT} "
                          "(cost model measured on the agent)")

# %% [markdown]
# ## Measured on the agent: HeteroLLM's partitions on the gpu (OpenCL) and npu (emulated) lanes
#
# The solver needs each lane's GEMM rate, the hand-off cost, and — new here — how much each lane slows while the
# other runs (on a phone the GPU and NPU share memory bandwidth; on this host they also share the two cores).

# %%
from IPython.display import display

N = 300 if PROMPT >= 300 else 45                                # unaligned
hp = pred = meas = None  # what the summary says of this section, when the gpu lane is there
if "gpu" not in dev.info["lanes"]:  # a device without OpenCL: one sentence, and the rest of the notebook runs
    print(f"No gpu lane on this device ({dev.info.get('lanes_missing', {}).get('gpu', 'not offered')}), so the "
          "measured GPU-NPU partitions are skipped.")
else:
    hp, _ = dev.measure_linears(qm, rows=(32, 64, 128, 256) if PROMPT < 256 else (32, 64, 128, 256, 512, 1024))
    print(f"npu {hp.npu_gops:.0f} GOP/s, gpu {hp.gpu_gflops:.0f} GFLOP/s, hand-off {hp.sync_us:.0f} µs; slowdown "
          f"when both run: npu x{hp.slowdown_npu:.2f}, gpu x{hp.slowdown_gpu:.2f}")
    pred = compare_strategies(smollm.config, N, hp)
    dev.prefill_hetero(qm, ids[:N], hp, "solver")                   # warm this length's shapes
    meas = {s: dev.prefill_hetero(qm, ids[:N], hp, s).trace.metrics()["makespan_ms"]
            for s in ("solver", "npu-pad", "pipe", "gpu", "seq-cut", "row-cut")}
    print(f"{N} tokens: solver picks " + ", ".join(sorted({c['strategy'] for c in pred['choices'].values()})))
    print(f"measured: solver vs padding {meas['npu-pad'] / meas['solver']:.2f}x "
          f"(predicted {pred['speedup_vs_padding']:.2f}x), "
          f"vs pipe {meas['pipe'] / meas['solver']:.2f}x (predicted {pred['speedup_vs_pipe']:.2f}x)")
    display(go.Figure(go.Bar(x=list(meas), y=list(meas.values()))).update_layout(
        title=f"Measured prefill of {N} tokens on the agent by partition strategy", yaxis_title="ms"))
dev.close()

# %%
# the headline numbers as data (tests/test_notebooks.py checks them)
import json
import pathlib

RESULTS_DIR = pathlib.Path(os.environ.get("EDGEPROBE_NB_RESULTS", "out"))
RESULTS_DIR.mkdir(parents=True, exist_ok=True)
results = {
    "memory_1024_256": {name: {k: m_[k] for k in ("saving", "shared_subgraphs", "subgraphs_per_chunk",
                                                  "chunk_graphs_bytes", "chunk_shared_bytes")}
                        for name, m_ in mem_rows},
    "modelled": {"in_order_ms": ino.makespan_us / 1e3, "ooo_ms": ooo.makespan_us / 1e3,
                 "npu_busy_in_order": ino.busy()["npu"], "npu_busy_ooo": ooo.busy()["npu"],
                 "decision_us": ooo.decision_us},
    "exact_gap": [{"prompt": p_, "subgraphs": n_, "gap": g_} for p_, n_, g_ in gaps],
    "hetero_modelled": {str(m_): {"total_ms": r_["total_ms"], "speedup_vs_padding": r_["speedup_vs_padding"],
                                  "speedup_vs_pipe": r_["speedup_vs_pipe"]} for m_, r_ in res.items()},
    "fit_error_median": {k: v["median"] for k, v in cm.fit_error().items() if k != "all"},
    "measured": {"prompt": PROMPT, "chunk": CHUNK,
                 **{s_: {"makespan_ms": mk[s_]["makespan_ms"],
                         "lanes": {k: v["busy_pct"] for k, v in mk[s_]["lanes"].items()},
                         "op_ms": measured[s_].trace.to_dataframe().groupby("lane")["dur_ms"].sum().to_dict()}
                    for s_ in mk},
                 "predicted_ooo_ms": measured["ooo"].schedule.makespan_us / 1e3,
                 "median_subgraph_error": float(np.median(np.abs(err)))},
    "makespan_by_chunk": {"prompt": PROMPT, "cost_model": cm.name, "rows": by_chunk},
    "lanes_offered": dev.info["lanes"], "lanes_missing": dev.info.get("lanes_missing", {}),
    "hetero_measured": None if meas is None else {
        "tokens": N, "makespan_ms": meas, "predicted_speedup_vs_padding": pred["speedup_vs_padding"],
        "predicted_total_ms": pred["total_ms"], "npu_gops": hp.npu_gops, "gpu_gflops": hp.gpu_gflops}}
(RESULTS_DIR / "06_scheduling.json").write_text(json.dumps(results, indent=1, default=float))
print(f"headline numbers written to {RESULTS_DIR / '06_scheduling.json'}: {', '.join(results)}")

# %% [markdown]
# ## What we found
#
# Rendered from this run's numbers: the cell below reads what the cells above computed.

# %%
from IPython.display import Markdown

mem = dict(mem_rows)
q, sm = mem["Qwen1.5-1.8B"], mem["SmolLM2-135M"]
ratio = ooo.makespan_us / ino.makespan_us
mi, mo = mk["in-order"], mk["ooo"]
idle = {s_: mk[s_]["makespan_ms"] * (1 - mk[s_]["lanes"]["npu"]["busy_pct"] / 100) for s_ in mk}
unaligned = [m_ for m_ in res if m_ % 256]
picks = [] if pred is None else sorted({c["strategy"] for c in pred["choices"].values()})
hetero_line = (f"""**Measured on the agent** it was not run: this device has no gpu lane
  ({dev.info.get("lanes_missing", {}).get("gpu", "not offered")}).""" if meas is None else
               f"""**Measured on the agent** the
  lanes slow each other (npu ×{hp.slowdown_npu:.1f}, gpu ×{hp.slowdown_gpu:.1f} while both run; here PoCL's "GPU" shares
  the CPU's cores); at {N} tokens the solver picks {", ".join(picks)} and measures
  {meas["npu-pad"] / meas["solver"]:.2f}× padding's speed (predicted {pred["speedup_vs_padding"]:.2f}×)
  and {meas["pipe"] / meas["solver"]:.2f}× the pipe's (predicted {pred["speedup_vs_pipe"]:.2f}×); a forced row cut
  takes {meas["row-cut"] / meas["solver"]:.2f}× the solver's time. A phone's separate GPU and NPU are where the paper's
  split gains live; the solver here is the same code with measured inputs.""")
Markdown(f"""Modelled on the Snapdragon 8 Gen 3 cost model and measured on this machine's agent.

- **Chunk-shared graphs save {q["saving"]:.0%} of pre-built graph memory** for Qwen1.5-1.8B at 1024 / 256 (paper: up to
  75 %), {sm["saving"]:.0%} for SmolLM2 (its attention buffers weigh more against its small weights);
  {q["shared_subgraphs"]} of {q["subgraphs_per_chunk"]} subgraphs per chunk are shared (paper: 120 of 144).
- **Out-of-order execution**, modelled: {ratio:.2f}× the in-order makespan for Qwen1.5-1.8B at 1024 / 256
  ({"inside" if 0.56 <= ratio <= 0.82 else "outside"} the paper's 0.56–0.82×), NPU busy {ino.busy()["npu"]:.0f}% →
  {ooo.busy()["npu"]:.0f}%, {ooo.decision_us:.1f} µs per decision. Against the exact optimum on small instances (one
  layer, {" / ".join(str(n_) for _, n_, _ in gaps)} subgraphs) the heuristic's gap is
  {" / ".join(f"{100 * g_:.1f}%" for *_, g_ in gaps)}.
- **Measured on our agent** (SmolLM2 w8a8-shadow, {PROMPT} / {CHUNK}): out-of-order over the measured cost model takes
  {mo["makespan_ms"]:.0f} ms against {mi["makespan_ms"]:.0f} ms in order
  (**{mo["makespan_ms"] / mi["makespan_ms"]:.2f}×**);
  the NPU lane's idle time goes from {idle["in-order"]:.0f} to {idle["ooo"]:.0f} ms (busy
  {mi["lanes"]["npu"]["busy_pct"]:.0f}% → {mo["lanes"]["npu"]["busy_pct"]:.0f}%). One run on a shared machine:
  `bench/schedule.py` repeats it side by side.
- **The fitted cost model** predicts chunk lengths left out of the fit with a median error per stage of
  {", ".join(f"{100 * v['median']:.0f}% ({k})" for k, v in cm.fit_error().items() if k != "all")}; the
  out-of-order makespan was predicted at {measured["ooo"].schedule.makespan_us / 1e3:.0f} ms, measured
  {mo["makespan_ms"]:.0f} ms.
- **Chunk length**, predicted over that cost model for a {PROMPT}-token prompt: out-of-order is shortest at chunk
  {best["ooo"]["chunk"]} ({best["ooo"]["makespan_ms"]:.0f} ms), in-order at chunk {best["in-order"]["chunk"]}
  ({best["in-order"]["makespan_ms"]:.0f} ms), over chunks {" / ".join(str(c_) for c_ in sweep_chunks)}.
- **HeteroLLM's solver**, modelled: beats padding """ + " / ".join(f"{res[m_]['speedup_vs_padding']:.2f}×"
                                                                  for m_ in unaligned) + f""" at
  {" / ".join(str(m_) for m_ in unaligned)} tokens (paper: up to 2.12×) and the pipe """ + " / ".join(
    f"{res[m_]['speedup_vs_pipe']:.2f}×" for m_ in unaligned) + f""" (paper: 13–30 %). {hetero_line}""")
