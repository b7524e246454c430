"""Where does the device part from the host? Per-op numerics of one prefill, device vs host (issue 41).

The agent summarizes each chosen op's output as it runs (edgeprobe_kernels.numerics.summarize: shape, dtype, L2,
max |x|, mean, a 64-bin log2|x| histogram, non-finite count) and sends some outputs whole; the host computes the same
at the same op names (the one template, run by graph.local's float plan) twice: under the scheme's own simulation
(the QuantizedModel's linears and head) and under the float model. Each op then gets two distances:
    device_vs_sim    a kernel bug or a rounding flip: the device against what its scheme says it computes
    scheme_vs_float  the quantization's price: the simulation against the float model
as relative L2 error ||a - b|| / ||b|| and max |a - b|, from the full tensors where both sides kept them
("method": "full"), else from the summaries alone ("method": "summary": the lower bounds | ||a|| - ||b|| | / ||b||
and | max|a| - max|b| |, which can miss a change that keeps the norm), and max_rel = max |a - b| / max |b|. The first
op in plan order whose device_vs_sim relative L2 exceeds `tolerance`, or whose max_rel exceeds `max_tolerance`, is
the first divergent op: relative L2 sees errors spread over a tensor, max_rel one int8 code rounded the other way
(it moves one column of a linear's output: ~1e-4 of max |x| against float32 reordering's ~1e-6, while the relative
L2 stays under 1e-4). Both default per scheme (`tolerances`).

    res = prefill_numerics(dev, qm, tokens, float_model=model)   # a RunResult; res.numerics is a NumericsReport
    res.numerics.first_divergent, res.numerics.figure(), res.numerics.write("out/")
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgeprobe_kernels.names import layer_of
from edgeprobe_kernels.numerics import HIST_BINS, HIST_LO, MAX_FULL_BYTES, select, summarize

from .errors import EdgeprobeError

DEFAULT_TOLERANCE = 1e-4   # device vs simulation relative L2 above which an op diverged: over float reordering (~1e-7),
                           # under one int8 code flipped in one element (~1e-3 in a 16-token SmolLM2 prefill)
DEFAULT_MAX_TOLERANCE = 2e-5  # max |diff| / max |sim| above which an op diverged: float32 reordering reached 8.4e-7
                              # (Gemma 3 w8a8, 32 tokens), a flipped input code of a linear 8.9e-5 (w8a8c-shadow)
# schemes whose device computes in float16 (q4_0-tile's k-ordered FP16 sums, NPU test-time scaling §5.1): the local
# agent's float16 rounding reaches relative L2 1.2e-3 and max_rel 1.9e-3 (SmolLM2 and Gemma 3, 32 tokens)
SCHEME_TOLERANCES = {"q4_0-tile": (5e-3, 1e-2)}
FORMAT = "edgeprobe-numerics/1"


class NumericsError(EdgeprobeError, ValueError):
    """A numerics capture that cannot be asked for: a pattern naming no op, an agent without capture, a full capture
    over the limit."""


def tolerances(scheme: str | None) -> tuple[float, float]:
    """The default (relative L2, max_rel) tolerances of a scheme's device-vs-simulation distance."""
    return SCHEME_TOLERANCES.get(scheme, (DEFAULT_TOLERANCE, DEFAULT_MAX_TOLERANCE))


def op_kind(name: str) -> str:
    """"blk.3.ffn_down" -> "ffn_down"; an op outside the layers is its own kind ("embed", "lm_head")."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def op_layer(name: str, n_layers: int) -> int:
    """The layer of a blk.{i} op; -1 before the layers (embed), n_layers after them (output_norm, lm_head)."""
    if name.startswith("blk."):
        return layer_of(name)
    return -1 if name == "embed" else n_layers


def op_names(config, n: int) -> list:
    """The host's op names of an n-token prefill in plan order (the template's float plan, nothing run)."""
    from .forward import HOST_OPS
    from .graph.local import float_plan

    return float_plan(config, n, 1, False, "last", HOST_OPS).order


def host_numerics(model, tokens, ops=None, full=(), linear=None, head=None,
                  limit_bytes: int | None = None) -> tuple[dict, dict | None]:
    """The host's capture of one prefill of `tokens` (int[T]) at the template's op names: {op: summary} and {op:
    float32 array} for the ops in `full`, with the caller's linear and head (a QuantizedModel's: the scheme's
    simulation; None: float). ops: a glob pattern (comma-separated) or None for every op. limit_bytes: the arrays
    kept at most (None: no limit); past it they are dropped and the second value is None."""
    from .forward import forward

    tokens = np.asarray(tokens, np.int64)
    names = op_names(model.config, len(tokens))
    chosen = set(select(names, ops)) | set(full)
    summaries, arrays, kept = {}, {}, [0]

    def seen(name, x):
        summaries[name] = summarize(x)
        if name in full and kept[0] >= 0:
            kept[0] += x.nbytes
            if limit_bytes is not None and kept[0] > limit_bytes:
                kept[0] = -1  # over the limit: keep none (the caller compares summaries)
                arrays.clear()
            else:
                arrays[name] = np.array(x, copy=True)

    forward(model, tokens, hooks={n: seen for n in chosen}, linear=linear, head=head, logits="last")
    return {n: summaries[n] for n in names if n in summaries}, (arrays if kept[0] >= 0 else None)


def _distance(a_sum: dict, b_sum: dict, a=None, b=None) -> dict:
    """How far a is from b: rel_l2, max_abs, max_rel (max_abs / max |b|) and the method (full tensors, or the
    summaries' lower bounds)."""
    if a is not None and b is not None and np.shape(a) == np.shape(b):
        d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
        ok = np.isfinite(d)
        d = d[ok] if not ok.all() else d
        diff = float(np.sqrt(np.dot(d.reshape(-1), d.reshape(-1))))
        rel, max_abs, method = diff / max(b_sum["l2"], 1e-30), float(np.abs(d).max()) if d.size else 0.0, "full"
    else:
        rel, max_abs, method = (abs(a_sum["l2"] - b_sum["l2"]) / max(b_sum["l2"], 1e-30),
                                abs(a_sum["max_abs"] - b_sum["max_abs"]), "summary")
    return {"rel_l2": rel, "max_abs": max_abs, "max_rel": max_abs / max(b_sum["max_abs"], 1e-30), "method": method}


@dataclass
class NumericsReport:
    """Per-op numerics of one run: `ops` in plan order, each {op, layer, kind, shape, device, sim, float (summaries),
    device_vs_sim, scheme_vs_float ({rel_l2, max_abs, max_rel, method}), nonfinite}; `first_divergent` the first op
    whose device_vs_sim rel_l2 exceeds `tolerance` or max_rel `max_tolerance` ({op, layer, kind, the distance, "by":
    "rel_l2", "max_rel" or "nonfinite"}; None: none did); `device_full` the device's outputs sent whole (to recompute
    an op from the device's own inputs)."""
    ops: list
    tolerance: float
    first_divergent: dict | None
    meta: dict = field(default_factory=dict)
    max_tolerance: float | None = None
    device_full: dict = field(default_factory=dict, repr=False)  # {op: the device's whole output}, not saved

    def by_name(self) -> dict:
        return {r["op"]: r for r in self.ops}

    def to_json(self) -> dict:
        return {"format": FORMAT, "tolerance": self.tolerance, "max_tolerance": self.max_tolerance,
                "metric": "rel_l2 = ||a - b|| / ||b||; max_rel = max |a - b| / max |b|",
                "hist": {"bins": HIST_BINS, "lo_log2": HIST_LO, "note": "bin b counts floor(log2|x|) == lo_log2 + b, "
                         "clamped into the bins; zeros and non-finite values are not counted"},
                "first_divergent": self.first_divergent, **self.meta, "ops": self.ops}

    def figure(self):
        """Divergence by depth: error per layer (x), one line per op kind, device vs simulation solid and scheme vs
        float dashed, on a log axis (a plotly Figure: the report, notebooks and Chromium draw it)."""
        import plotly.graph_objects as go

        fig = go.Figure()
        kinds = list(dict.fromkeys(r["kind"] for r in self.ops))
        for dist, dash in (("device_vs_sim", "solid"), ("scheme_vs_float", "dash")):
            for k in kinds:
                rows = [r for r in self.ops if r["kind"] == k and r.get(dist)]
                if not rows:
                    continue
                fig.add_trace(go.Scatter(x=[r["layer"] for r in rows],
                                         y=[max(r[dist]["rel_l2"], 1e-12) for r in rows], mode="lines+markers",
                                         name=f"{k} ({dist.replace('_', ' ')})", legendgroup=dist,
                                         line={"dash": dash}, customdata=[[r["op"], r[dist]["method"],
                                                                           r[dist]["max_abs"]] for r in rows],
                                         hovertemplate="%{customdata[0]}<br>rel L2 %{y:.3g} (%{customdata[1]})"
                                                       "<br>max |diff| %{customdata[2]:.3g}<extra></extra>"))
        fig.add_hline(y=self.tolerance, line_dash="dot", annotation_text=f"tolerance {self.tolerance:g}")
        title = "divergence by depth: device vs simulation (solid), scheme vs float (dashed)"
        if self.first_divergent:
            title += f"; first divergent op {self.first_divergent['op']}"
        fig.update_layout(title=title, xaxis_title="layer (-1: embed; last: output_norm, lm_head)",
                          yaxis_title="relative L2 error", yaxis_type="log", template="plotly_white")
        return fig

    def write(self, out_dir) -> dict:
        """numerics.json and numerics.html (the figure, plotly.js inlined: it draws offline) -> their paths."""
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        paths = {"json": str(d / "numerics.json"), "html": str(d / "numerics.html")}
        Path(paths["json"]).write_text(json.dumps(self.to_json(), indent=1))
        self.figure().write_html(paths["html"], include_plotlyjs=True)
        return paths


def compare(device: dict, sim: dict, float_: dict | None, n_layers: int, tolerance: float = DEFAULT_TOLERANCE,
            device_full: dict | None = None, sim_full: dict | None = None, float_full: dict | None = None,
            order=None, max_tolerance: float | None = DEFAULT_MAX_TOLERANCE) -> NumericsReport:
    """The report from three captures ({op: summary}, and {op: array} where kept): device against the scheme's
    simulation, and the simulation against float, op by op in `order` (default: the simulation's). max_tolerance
    None: max_rel decides nothing."""
    device_full, sim_full, float_full = device_full or {}, sim_full or {}, float_full or {}
    rows, first = [], None
    for name in order or list(sim):
        if name not in device or name not in sim:
            continue
        r = {"op": name, "layer": op_layer(name, n_layers), "kind": op_kind(name), "shape": device[name]["shape"],
             "nonfinite": device[name]["nonfinite"], "device": device[name], "sim": sim[name],
             "device_vs_sim": _distance(device[name], sim[name], device_full.get(name), sim_full.get(name))}
        if float_ is not None and name in float_:
            r["float"] = float_[name]
            r["scheme_vs_float"] = _distance(sim[name], float_[name], sim_full.get(name), float_full.get(name))
        d = r["device_vs_sim"]
        by = ("nonfinite" if r["nonfinite"] else "rel_l2" if d["rel_l2"] > tolerance else
              "max_rel" if max_tolerance is not None and d["max_rel"] > max_tolerance else None)
        if first is None and by:
            first = {"op": name, "layer": r["layer"], "kind": r["kind"], **d, "by": by}
        rows.append(r)
    return NumericsReport(rows, tolerance, first, max_tolerance=max_tolerance)


def prefill_numerics(dev, qm, tokens, ops=None, full=None, float_model=None, tolerance: float | None = None,
                     limit_bytes: int = MAX_FULL_BYTES, progress: bool = False, fault: dict | None = None,
                     max_tolerance: float | None = None):
    """A layer-by-layer prefill of `tokens` on `dev` with numerics captured at the ops `ops` picks (glob, None: all),
    and the host's captures -> the RunResult, with .numerics a NumericsReport. full: op names sent whole; None: every
    picked op when they fit `limit_bytes`, else none (the report then compares summaries). float_model: the float
    Model for scheme_vs_float (None: not computed). tolerance, max_tolerance: None gives the scheme's
    (`tolerances`). fault: TEST ONLY, {"op", "index", "codes"} (see
    edgeprobe_kernels.numerics.Capture). Raises NumericsError before running for a pattern naming no op, a full
    capture over the limit, and after it for an agent that does not capture."""
    from .plan import prefill_plan

    tokens = np.asarray(tokens, np.int32)
    plan = prefill_plan(qm.manifest, len(tokens))
    names = [o["name"] for o in plan["ops"]]
    picked = select(names, ops)
    if not picked:
        raise NumericsError(f"--numerics-ops {ops!r} names no op of the plan (ops are named like {names[1]!r}, "
                            f"'blk.1.*', 'lm_head')")
    # a linear the plan splits (w8a8-shadow's int8 part on the npu, its shadow on the cpu) is the host's one op at
    # its join, "<linear>.sum": the host captures it under the linear's name
    joins = {n: n[:-4] for n in names if n.endswith(".sum") and n[:-4] not in names}

    def on_host(ns):
        return [joins.get(n, n) for n in ns]

    host_ops = ",".join(on_host(picked)) if joins else ops
    # the simulation first: its shapes size the full capture before the device spends anything
    sim, sim_arrays = host_numerics(qm.model, tokens, host_ops, on_host(picked if full is None else full),
                                    linear=qm.linear, limit_bytes=limit_bytes if full is None else None)
    sizes = {n: int(np.prod(s["shape"])) * 4 for n, s in sim.items()}
    if full is None:
        full = picked if sim_arrays is not None else []
        sim_arrays = sim_arrays or {}
    else:
        unknown = [n for n in full if n not in names]
        if unknown:
            raise NumericsError(f"full capture names {unknown[:3]}, which are not ops of the plan")
        need = sum(sizes.get(n, 0) for n in on_host(full))
        if need > limit_bytes:
            raise NumericsError(f"full capture of {len(full)} ops is {need} bytes ({need / 2**20:.1f} MiB), over the "
                                f"limit of {limit_bytes} bytes: capture fewer ops in full")
    whole = set(on_host(full))
    sim_arrays = {n: a for n, a in sim_arrays.items() if n in whole}
    field_ = {"ops": ops, "full": list(full), "full_limit_bytes": int(limit_bytes)}
    if fault:
        field_["fault"] = fault
    plan_id = dev.plan_for(qm, ("prefill", len(tokens), "cpu"), lambda: plan, progress=progress)
    res = dev.run(plan_id, {"tokens": tokens}, title=f"prefill {len(tokens)} tokens, {qm.scheme}, numerics captured",
                  numerics=field_)
    if res.numerics_raw is None:
        raise NumericsError(f"the agent (version {dev.info.get('agent_version')}) does not capture numerics: its run "
                            "reply has no 'numerics'; update the agent (edgeprobe agent) to one that does")
    got, got_full = res.numerics_raw
    dev_sum = {joins.get(s["op"], s["op"]): s for s in got["summaries"]}
    dev_full = dict(zip(on_host(got["full"]), got_full))
    flt, flt_arrays = host_numerics(float_model, tokens, host_ops, on_host(full)) if float_model is not None \
        else (None, {})
    tol, max_tol = tolerances(qm.scheme)
    report = compare(dev_sum, sim, flt, qm.model.config.n_layers, tol if tolerance is None else tolerance, dev_full,
                     sim_arrays, flt_arrays, order=on_host(names),
                     max_tolerance=max_tol if max_tolerance is None else max_tolerance)
    report.meta = {"scheme": qm.scheme, "tokens": int(len(tokens)), "ops_captured": len(dev_sum),
                   "full_captured": len(dev_full), "full_bytes": int(got.get("full_bytes", 0)),
                   "agent": dev.info.get("agent_version"), "fault": fault}
    report.device_full = dev_full
    res.numerics = report
    return res
