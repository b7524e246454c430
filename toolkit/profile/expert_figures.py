"""Plotly figures of MoE routing, per-expert widths and expert buffers, drawn as EdgeMoE draws them
(Fig. 4 paths, Fig. 7a sensitivity, Fig. 8 conditional tables, Fig. 13 buffer hit rates, Fig. 15 size vs loss)."""
from __future__ import annotations

import numpy as np

from .figures import legend_below, plotly_go

COACTIVATION_KINDS = ("frequency", "paths", "conditional", "predictor")
BITS_KINDS = ("sensitivity", "tolerance")


def coactivation_figure(st, kind: str = "frequency", layer: int | None = None, heldout=None):
    """kind: frequency (layer x expert load), paths (Fig. 4), conditional (Fig. 8; `layer`, default
    the most predictable), predictor (top-n hit rate by order; needs `heldout`, a RoutingTrace)."""
    go = plotly_go()
    if kind not in COACTIVATION_KINDS:
        raise ValueError(f"unknown co-activation figure {kind!r}; choose one of {COACTIVATION_KINDS}")
    tail = f"{st.model_name}, {st.tokens:,} tokens, {st.E} experts, top-{st.params['k']}"
    if kind == "frequency":
        f = 100 * st.expert_frequency() / st.params["k"]
        lb = st.load_balance()
        fig = go.Figure(go.Heatmap(z=f, x=[f"E{e}" for e in range(st.E)], y=list(range(st.L)), colorscale="Blues",
                                   colorbar=dict(title="% of routings"), texttemplate="%{z:.1f}",
                                   hovertemplate="layer %{y}, expert %{x}: %{z:.2f}% of routings<extra></extra>"))
        fig.update_layout(title=f"Expert load per layer (even = {100 / st.E:.1f}%; max/mean "
                          f"{lb['max_over_mean'].min():.2f}–{lb['max_over_mean'].max():.2f})<br><sup>{tail}</sup>",
                          xaxis_title="expert", yaxis=dict(title="layer", autorange="reversed"))
        return fig
    if kind == "paths":
        from plotly.subplots import make_subplots

        c = st.path_counts()
        pl = st.power_law()
        ranks = np.arange(1, len(c) + 1)
        cov = np.cumsum(c) / max(c.sum(), 1)
        fig = make_subplots(rows=1, cols=2,
                            subplot_titles=("tokens per path, by rank", "tokens covered by the top paths"))
        idx = np.unique(np.geomspace(1, len(c), 500).astype(int)) - 1 if len(c) else np.zeros(0, int)
        fig.add_scatter(x=ranks[idx], y=c[idx], mode="markers", name="observed paths", row=1, col=1)
        if np.isfinite(pl["alpha"]):
            fr = ranks[:pl["paths_fitted"]]
            fig.add_scatter(x=fr, y=10 ** pl["log10_c"] * fr ** -pl["alpha"], mode="lines", row=1, col=1,
                            name=f"power law: rank^-{pl['alpha']:.2f} (R² {pl['r2']:.2f})")
        fig.add_scatter(x=100 * ranks[idx] / max(len(c), 1), y=100 * cov[idx], mode="lines", name="cumulative",
                        row=1, col=2)
        share = 100 * st.path_coverage(0.2)
        fig.add_vline(x=20, line_dash="dot", row=1, col=2)
        fig.add_annotation(x=20, y=share, text=f"top 20% of paths: {share:.1f}% of tokens (EdgeMoE: >99%)",
                           row=1, col=2, showarrow=True, xanchor="left")
        fig.update_xaxes(type="log", title_text="path rank", row=1, col=1)
        fig.update_yaxes(type="log", title_text="tokens", row=1, col=1)
        fig.update_xaxes(title_text="paths, ranked (%)", row=1, col=2)
        fig.update_yaxes(title_text="tokens covered (%)", range=[0, 101], row=1, col=2)
        fig.update_layout(title=f"Activation paths (top-1 expert per layer, {st.params['path_layers']} layers; "
                          f"{pl['paths_observed']:,} of {pl['paths_possible']:,} seen) — EdgeMoE Fig. 4"
                          f"<br><sup>{tail}</sup>",
                          legend=legend_below())
        return fig
    if kind == "conditional":
        from plotly.subplots import make_subplots

        peak = st.conditional_peak(2)
        layer = int(np.nanargmax(peak)) if layer is None else int(layer)
        p1 = st.conditional(layer, 1)
        p2 = st.conditional(layer, 2) if layer >= 2 else None
        fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.12,
                            subplot_titles=(f"P(E{layer} = i | top-1 E{layer - 1} = a)",
                                            f"P(E{layer} = i | E{layer - 2} = b, E{layer - 1} = a), "
                                            "16 most common (b, a)"))
        ex = [f"E{e}" for e in range(st.E)]
        fig.add_heatmap(z=100 * p1, x=ex, y=[f"a={a}" for a in range(st.E)], colorscale="Reds", zmin=0, zmax=100,
                        texttemplate="%{z:.0f}", row=1, col=1, colorbar=dict(title="%"))
        if p2 is not None:
            n2 = st.a["n2"][layer]
            top = np.argsort(-n2, axis=None)[:16]
            rows = [divmod(int(i), st.E) for i in top if n2.flat[i] > 0]
            fig.add_heatmap(z=np.array([100 * p2[b, a] for b, a in rows]), x=ex,
                            y=[f"b={b},a={a} (n={n2[b, a]})" for b, a in rows],
                            colorscale="Reds", zmin=0, zmax=100, texttemplate="%{z:.0f}", showscale=False, row=1, col=2)
        fig.update_yaxes(autorange="reversed")
        fig.update_layout(title=f"Consecutive layers' experts are correlated (EdgeMoE Fig. 8): layer {layer}, "
                          "mean peak "
                          f"P(i | b, a) = {100 * peak[layer]:.0f}%<br><sup>{tail}; rows need not sum to 100%: "
                          f"k = {st.params['k']} experts are chosen</sup>", height=560)
        return fig
    if heldout is None:
        raise ValueError("the predictor figure needs heldout=RoutingTrace of held-out tokens")
    fig = go.Figure()
    ns = list(range(1, st.E + 1))
    for order, name in ((0, "frequency only"), (1, "P(E_n | E_n-1)"), (2, "P(E_n | E_n-1, E_n-2)")):
        pred = st.predictor(order)
        fig.add_scatter(x=ns, y=[100 * pred.hit_rate(heldout, n)["mean"] for n in ns], mode="lines+markers", name=name)
    fig.add_scatter(x=ns, y=[100 * n / st.E for n in ns], mode="lines", name="random",
                    line=dict(dash="dot", color="gray"))
    fig.update_layout(title=f"Preload predictor: share of next-layer experts among the top-n predicted "
                      f"({heldout.tokens:,} held-out tokens)<br><sup>{tail}</sup>",
                      xaxis_title="experts preloaded per layer (n)", yaxis_title="hit rate (%)", legend=legend_below())
    return fig


def bits_figure(study, kind: str = "sensitivity", selections=None):
    """kind: sensitivity (Fig. 7a heatmap; measured first if needed), tolerance (Fig. 15; `selections`
    from study.curve(), computed if not given)."""
    go = plotly_go()
    if kind not in BITS_KINDS:
        raise ValueError(f"unknown bit-width figure {kind!r}; choose one of {BITS_KINDS}")
    m = study.model
    tail = f"{m.name}, {study.tokens:,} calibration tokens; float loss {study.float_loss:.4f} nats"
    if kind == "sensitivity":
        s = study.sensitivity if study.sensitivity is not None else study.measure_sensitivity()
        fig = go.Figure(go.Heatmap(z=1000 * s, x=[f"E{e}" for e in range(study.E)], y=list(range(study.L)),
                                   colorscale="YlOrRd", texttemplate="%{z:.1f}", colorbar=dict(title="Δ loss (mnats)"),
                                   hovertemplate="layer %{y}, expert %{x}: +%{z:.2f} mnats<extra></extra>"))
        fig.update_layout(title="Loss increase with one expert at INT2, all others INT4 (EdgeMoE Fig. 7a)"
                                f"<br><sup>{tail}</sup>",
                          xaxis_title="expert", yaxis=dict(title="layer", autorange="reversed"))
        return fig
    sel = selections if selections is not None else study.curve()
    fig = go.Figure()
    fig.add_scatter(x=[s.model_bytes / 1e6 for s in sel], y=[100 * s.perplexity_increase for s in sel],
                    mode="lines+markers+text", text=[f"P={100 * s.tolerance:g}%" for s in sel],
                    textposition="top right",
                    customdata=[[s.k_low, s.low, s.high] for s in sel], name="EdgeMoE selection",
                    hovertemplate="%{x:.2f} MB, +%{y:.2f}% ppl<br>%{customdata[0]} experts at INT%{customdata[1]}, "
                                  "rest INT%{customdata[2]}<extra></extra>")
    for b, color in ((2, "#d62728"), (4, "#2ca02c"), (8, "#1f77b4")):
        nb = study.L * study.E * study.expert_nbytes(b) + study.other_nbytes()
        fig.add_scatter(x=[nb / 1e6], y=[100 * np.expm1(study.uniform[b] - study.float_loss)], mode="markers",
                        marker=dict(symbol="diamond", size=11, color=color), name=f"all experts INT{b}")
    fig.update_layout(title="Model size against loss as the tolerated loss P varies (EdgeMoE Fig. 15)"
                            f"<br><sup>{tail}</sup>",
                      xaxis_title="model bytes (MB)", yaxis_title="perplexity increase vs float (%)",
                      legend=legend_below())
    return fig


def cache_figure(rows: list[dict], expert_bytes: int, title_tail: str = ""):
    """Fig. 13: hit rate and bytes read per token against buffer size, per policy, +/- preloading."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("hit rate", "bytes read from flash per token"))
    colors = {"fifo": "#1f77b4", "lru": "#ff7f0e", "lfu": "#2ca02c", "edgemoe": "#d62728"}
    for pol in dict.fromkeys(r["policy"] for r in rows):
        for pre in (False, True):
            rs = sorted((r for r in rows if r["policy"] == pol and r["preload"] == pre), key=lambda r: r["capacity"])
            if not rs:
                continue
            x = [r["buffer_bytes"] / 1e6 for r in rs]
            style = dict(color=colors.get(pol), dash="dash" if pre else "solid")
            name = f"{pol}{' + preload' if pre else ''}"
            fig.add_scatter(x=x, y=[100 * r["hit_rate"] for r in rs], mode="lines+markers", line=style, name=name,
                            legendgroup=name, row=1, col=1)
            fig.add_scatter(x=x, y=[r["bytes_per_token"] / 1e6 for r in rs], mode="lines+markers", line=style,
                            name=name, legendgroup=name, showlegend=False, row=1, col=2)
    fig.update_xaxes(title_text="expert buffer (MB)")
    fig.update_yaxes(title_text="%", row=1, col=1)
    fig.update_yaxes(title_text="MB per token", row=1, col=2)
    fig.update_layout(title=f"Expert buffer policies on real routing (EdgeMoE Fig. 13; dashed: with preloading)"
                      f"<br><sup>{title_tail}</sup>", legend=legend_below())
    return fig
