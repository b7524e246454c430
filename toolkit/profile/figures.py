"""Plotly figures of the profiles, drawn as the papers draw them (mllm-NPU Fig. 10-12; LLM in a flash)."""
from __future__ import annotations

import numpy as np


def plotly_go():
    import plotly.graph_objects as go

    return go


OUTLIER_KINDS = ("channels", "share", "importance", "histogram")
SPARSITY_KINDS = ("inactive", "frequency", "window")


def outlier_figure(st, kind: str = "channels"):
    go = plotly_go()
    points = st.points  # from the stats, not outliers.py (that module draws with this one); an MoE has no ffn_act

    if kind not in OUTLIER_KINDS:
        raise ValueError(f"unknown outlier figure {kind!r}; choose one of {OUTLIER_KINDS}")
    L = st._layers()
    layers = np.arange(L)
    title_tail = f"{st.model_name}, {st.tokens:,} tokens, clip = p{st.params['percentile']:g} of |x|"
    if kind == "channels":  # Fig. 10
        cpl = st.channels_per_layer()
        fig = go.Figure()
        for p in points:
            fig.add_bar(x=layers, y=cpl[f"{p}_per_window"], name=p,
                        customdata=cpl[f"{p}_pct_window"],
                        hovertemplate="layer %{x}<br>%{y:.1f} channels (%{customdata:.2f}%)<extra>" + p + "</extra>")
        fig.add_scatter(x=layers, y=cpl["pct_window"], name="% of channels (mean)", yaxis="y2",
                        mode="lines+markers", line=dict(color="black"))
        window = st.windows and st.tokens // st.windows
        fig.update_layout(barmode="group", title=f"Outlier channels per layer per {window}-token "
                          f"inference (mllm-NPU Fig. 10)<br><sup>{title_tail}</sup>",
                          xaxis_title="layer", yaxis_title="channels with an outlier",
                          yaxis2=_right_axis("% of channels"), legend=legend_below())
        return fig
    if kind == "share":  # Fig. 11
        fig = go.Figure()

        def curve(cum):  # ~400 log-spaced ranks keep the HTML small and the curve exact at those ranks
            idx = np.unique(np.geomspace(1, len(cum), 400).astype(int)) - 1
            return 100 * (idx + 1) / len(cum), 100 * cum[idx]

        for p in points:
            x, y = curve(st.channel_share([n for n in st.names if n.endswith(p)]))
            fig.add_scatter(x=x, y=y, name=p, mode="lines")
        x, y = curve(st.channel_share())
        pct = st.share_channels(0.8)
        fig.add_scatter(x=x, y=y, name="all tensors", mode="lines", line=dict(color="black", width=3))
        fig.add_hline(y=80, line_dash="dot", annotation_text=f"80% of outliers from {pct:.2f}% of channels")
        fig.update_layout(title=f"Share of outliers by channel rank (mllm-NPU Fig. 11)<br><sup>{title_tail}</sup>",
                          xaxis_title="channels, ranked by outlier count (%)",
                          yaxis_title="cumulative share of outliers (%)",
                          xaxis=dict(type="log", tickvals=[0.01, 0.1, 1, 10, 100],
                                     ticktext=["0.01", "0.1", "1", "10", "100"]),
                          legend=legend_below())
        return fig
    if kind == "importance":  # Fig. 12
        imp = st.layer_importance()
        pruned = np.zeros(L, bool)
        pruned[st.pruned_layers()] = True
        fig = go.Figure()
        for mask, name, color in ((~pruned, "outliers kept", "#d62728"), (pruned, "outliers pruned (85%)", "#bbbbbb")):
            fig.add_bar(x=layers[mask], y=imp[mask], name=name, marker_color=color,
                        hovertemplate="layer %{x}<br>max|x| / clip = %{y:.2f}<extra></extra>")
        top = np.log10(max(float(imp.max()), 2.0)) * 1.05
        fig.update_layout(title=f"Outlier importance per layer (mllm-NPU Fig. 12)<br><sup>{title_tail}</sup>",
                          xaxis_title="layer", yaxis=dict(title="max |x| / clip (1 = no outlier)", type="log",
                                                          range=[0, top]), legend=legend_below())
        return fig
    # histogram: per layer, share of values by |x| / clip octave (rows) at the ffn_act input
    edges = st.params["ratio_edges"]
    z = []
    for i in layers:
        h = sum(st.arrays[f"blk.{i}.{p}"]["hist"].sum(axis=0) for p in points)
        with np.errstate(divide="ignore"):
            z.append(np.where(h > 0, np.log10(np.maximum(h, 1)), np.nan))  # empty cells stay blank
    labels = [f"{lo:g}–{hi:g}" for lo, hi in zip(edges[:-1], edges[1:])] + [f"≥{edges[-1]:g}"]
    fig = go.Figure(go.Heatmap(z=np.array(z).T, x=layers, y=labels, colorscale="Viridis",
                               colorbar=dict(title="log10(count)")))
    fig.update_layout(title=f"|x| / clip by layer, all linear inputs (counts per range)<br><sup>{title_tail}</sup>",
                      xaxis_title="layer", yaxis_title="|x| / clip")
    return fig


def sparsity_figure(st, kind: str = "inactive"):
    go = plotly_go()
    if kind not in SPARSITY_KINDS:
        raise ValueError(f"unknown sparsity figure {kind!r}; choose one of {SPARSITY_KINDS}")
    L = st.n_layers
    layers = np.arange(L)
    tail = f"{st.model_name}, {st.tokens:,} tokens, eps = {100 * st.params['eps']:g}%"
    if kind == "inactive":
        fig = go.Figure()
        fig.add_bar(x=layers, y=100 * st.inactive_fraction(), name="inactive neurons (%)")
        fig.add_scatter(x=layers, y=100 * st.achieved_error(), name="FFN output error (%)", yaxis="y2",
                        mode="lines+markers")
        fig.update_layout(title=f"FFN neurons below the per-layer threshold<br><sup>{tail}</sup>", xaxis_title="layer",
                          yaxis_title="inactive (%)", yaxis2=_right_axis("FFN output error, relative L2 (%)"),
                          legend=legend_below())
        return fig
    if kind == "frequency":
        z = np.array([np.sort(st.frequency(i))[::-1] for i in layers])
        fig = go.Figure(go.Heatmap(z=z, x=100 * np.arange(1, z.shape[1] + 1) / z.shape[1], y=layers,
                                   colorscale="Magma", colorbar=dict(title="firing frequency")))
        hot = st.hot_fraction(0.8)
        fig.update_layout(title=f"Neuron firing frequency, ranked per layer (80% of firings from {hot.mean():.0f}% "
                          f"of neurons on average)<br><sup>{tail}</sup>", xaxis_title="neurons ranked by frequency (%)",
                          yaxis_title="layer")
        return fig
    from plotly.subplots import make_subplots

    w = st.window()
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("neurons resident in DRAM", "neurons loaded from flash per token"))
    fig.add_scatter(x=w["k"], y=w["resident"], name="resident", mode="lines+markers", row=1, col=1)
    fig.add_scatter(x=w["k"], y=w["new"], name="loaded per token", mode="lines+markers", row=2, col=1,
                    customdata=w["bytes"] / 1024,
                    hovertemplate="k=%{x}: %{y:.1f} neurons, %{customdata:.1f} KiB<extra></extra>")
    fig.update_yaxes(title_text="neurons per layer", row=1, col=1)
    fig.update_yaxes(title_text="neurons per token per layer", type="log", row=2, col=1)
    fig.update_xaxes(title_text="window k (tokens)", dtick=1, row=2, col=1)
    fig.update_layout(title=f"Sliding window (LLM in a flash §3.2)<br><sup>{tail}</sup>", showlegend=False, height=700)
    return fig


def _right_axis(title: str) -> dict:
    """A secondary y-axis with its own ticks (not aligned to the left grid, which gives odd values)."""
    return dict(title=title, overlaying="y", side="right", rangemode="tozero", showgrid=False, tickmode="auto")


def legend_below() -> dict:
    return dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0)


def write_html(fig, path) -> None:
    """Self-contained HTML (plotly.js inlined): opens offline, in a browser or a report."""
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
