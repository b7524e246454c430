"""Figures researchers asked for beside the timelines (issue 39): the numbers first, then a plotly figure of them.

    rows = makespan_rows(qm.manifest, 1024, (64, 128, 256, 512), ("in-order", "ooo"), cost_model("snapdragon-8gen3"))
    makespan_figure(rows)                          # predicted prefill makespan against chunk length, per scheduler
    sqnr = layer_sqnr(model, quantized, acts)      # {scheme: float64[n_layers]} in dB
    sqnr_figure(sqnr)                              # per-layer quantization error, one line per scheme

Each figure carries exactly the numbers its rows function returned (tests/test_figures.py checks it), so a notebook
renders its conclusion from the same numbers the figure shows. Figures render offline like toolkit/trace.py's.
"""
from __future__ import annotations

import numpy as np

# an exact copy has no noise: its SQNR is capped here so that it stays plottable on a dB axis (and JSON-able)
SQNR_CAP_DB = 200.0


def sqnr_db(reference, approx, cap: float = SQNR_CAP_DB) -> float:
    """Signal-to-quantization-noise ratio of `approx` against `reference` (same shape, any float dtype), in dB:
    10·log10(Σ ref² / Σ (ref − approx)²), computed in float64; `cap` when the two are equal (no noise)."""
    ref = np.asarray(reference, np.float64)
    return _db(float(np.sum(ref ** 2)), float(np.sum((ref - np.asarray(approx, np.float64)) ** 2)), cap)


def _db(signal: float, noise: float, cap: float) -> float:
    """10·log10(signal / noise) clamped to ±cap: `cap` without noise, `-cap` for noise on a zero signal."""
    if noise == 0.0:
        return cap
    if signal == 0.0:
        return -cap
    return min(cap, 10.0 * np.log10(signal / noise))


def layer_sqnr(model, quantized: dict, acts: dict, cap: float = SQNR_CAP_DB) -> dict:
    """Per-layer SQNR of each scheme's linears against float: for layer i, the float outputs y = x·Wᵀ of its seven
    linears (inputs x: the float forward pass's activations, `acts` from forward(..., hooks=) keyed by hook name) are
    concatenated and compared with quantized[scheme].linear(name, x) the same way (one signal, one noise per layer).
    Returns {scheme: float64[n_layers]} in dB (mllm-NPU §3.3: where the per-tensor W8A8 error comes from)."""
    from .quant.schemes import INPUT_POINT

    L = model.config.n_layers
    out = {s: np.zeros(L) for s in quantized}
    for i in range(L):
        signal, noise = 0.0, {s: 0.0 for s in quantized}
        for op, point in INPUT_POINT.items():
            name, x = f"blk.{i}.{op}", acts[f"blk.{i}.{point}"]
            y = np.asarray(x @ model.weights[name + ".weight"].T, np.float64)
            signal += float(np.sum(y ** 2))
            for s, qm in quantized.items():
                noise[s] += float(np.sum((y - np.asarray(qm.linear(name, x), np.float64)) ** 2))
        for s in quantized:
            out[s][i] = _db(signal, noise[s], cap)
    return out


def sqnr_figure(sqnr: dict, title: str = "Per-layer quantization error of the linears"):
    """{scheme: SQNR dB per layer} -> a plotly Figure: one line per scheme, layer on x, dB on y (higher = closer to
    float; every 6 dB is one bit)."""
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=list(range(len(v))), y=[float(d) for d in v], name=s, mode="lines+markers",
                                hovertemplate=f"{s}<br>layer %{{x}}: %{{y:.1f}} dB<extra></extra>")
                     for s, v in sqnr.items()])
    fig.update_layout(title=title, xaxis_title="layer", yaxis_title="SQNR (dB, higher is better)",
                      legend_title_text="scheme")
    return fig


def makespan_rows(manifest: dict, prompt_len: int, chunks, schedulers, cost) -> list[dict]:
    """The predicted prefill makespan of a quantized model (its manifest: which layers keep shadow GEMMs) at each
    chunk length and scheduler, from schedule.predict.predicted_schedule (the prediction `edgeprobe schedule` and
    `run` make). A chunk longer than the prompt is one chunk of all of it, as run. cost: a CostModel object.
    Returns [{chunk, scheduler, makespan_ms, subgraphs, npu_busy_pct}] in chunks × schedulers order."""
    from .schedule.predict import predicted_schedule

    rows = []
    for chunk in chunks:
        c = min(int(chunk), prompt_len)
        for s in schedulers:
            graph, sched = predicted_schedule(manifest, prompt_len, c, s, cost)
            rows.append({"chunk": c, "scheduler": s, "makespan_ms": sched.makespan_us / 1e3,
                         "subgraphs": len(graph.subgraphs), "npu_busy_pct": sched.busy().get("npu", 0.0)})
    return rows


def makespan_figure(rows: list[dict], title: str | None = None, cost_name: str = ""):
    """makespan_rows' rows -> a plotly Figure: predicted makespan (ms) against chunk length, one line per scheduler
    (mllm-NPU §3.2: short chunks pay more launches and syncs, long ones leave fewer subgraphs to overlap)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for s in dict.fromkeys(r["scheduler"] for r in rows):
        pts = [r for r in rows if r["scheduler"] == s]
        fig.add_scatter(x=[r["chunk"] for r in pts], y=[r["makespan_ms"] for r in pts], name=s, mode="lines+markers",
                        hovertemplate=f"{s}<br>chunk %{{x}}: %{{y:.1f}} ms<extra></extra>")
    title = title or "Predicted prefill makespan against chunk length" + (f" ({cost_name})" if cost_name else "")
    fig.update_layout(title=title,
                      xaxis_title="chunk length (tokens)", yaxis_title="makespan (ms, predicted)", xaxis_type="log",
                      legend_title_text="scheduler")
    return fig
