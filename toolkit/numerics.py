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

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgeprobe_agent.protocol import leaf_names
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


def op_names(config, n: int, session: bool = False) -> list:
    """The host's op names of an n-token prefill in plan order (the template's float plan, nothing run); session: the
    n tokens extend a KV cache (a decode step is n=1)."""
    from .forward import HOST_OPS
    from .graph.local import float_plan

    return float_plan(config, n, 1, session, "last", HOST_OPS).order


def plan_op_names(plan: dict) -> list:
    """The op names an agent's capture picks from in an agent plan, in plan order: a fused op's sub-ops in its place
    (a decode step's one op `step` -> embed, blk.0.attn_norm, ..., lm_head), as edgeprobe_agent.executor's
    capture_names."""
    return leaf_names(plan["ops"])


def host_numerics(model, tokens, ops=None, full=(), linear=None, head=None,
                  limit_bytes: int | None = None, cache=None) -> tuple[dict, dict | None]:
    """The host's capture of one prefill of `tokens` (int[T]) at the template's op names: {op: summary} and {op:
    float32 array} for the ops in `full`, with the caller's linear and head (a QuantizedModel's: the scheme's
    simulation; None: float). ops: a glob pattern (comma-separated) or None for every op. limit_bytes: the arrays
    kept at most (None: no limit); past it they are dropped and the second value is None. cache: a forward.KVCache
    the tokens extend (a decode step: its positions follow the cache's, which moves on by len(tokens))."""
    from .forward import forward

    tokens = np.asarray(tokens, np.int64)
    names = op_names(model.config, len(tokens), cache is not None)
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

    forward(model, tokens, cache=cache, hooks={n: seen for n in chosen}, linear=linear, head=head, logits="last")
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
        float dashed, on a log axis (a plotly Figure: the report, notebooks and Chromium draw it). Where a kind has
        several ops in a layer (a chunked prefill's chunks, a split linear's pieces), the layer's point is the largest,
        and its hover names that op."""
        import plotly.graph_objects as go

        fig = go.Figure()
        kinds = list(dict.fromkeys(r["kind"] for r in self.ops))
        for dist, dash in (("device_vs_sim", "solid"), ("scheme_vs_float", "dash")):
            for k in kinds:
                worst: dict = {}
                for r in self.ops:
                    if r["kind"] == k and r.get(dist) and (r["layer"] not in worst or r[dist]["rel_l2"] >
                                                            worst[r["layer"]][dist]["rel_l2"]):
                        worst[r["layer"]] = r
                rows = sorted(worst.values(), key=lambda r: r["layer"])
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
        """numerics.json and numerics.html (the figure, plotly.js inlined: it draws offline) -> their paths. Any
        report with to_json() and figure() (DecodeNumerics too) writes itself through here."""
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        paths = {"json": str(d / "numerics.json"), "html": str(d / "numerics.html")}
        Path(paths["json"]).write_text(json.dumps(self.to_json(), indent=1))
        self.figure().write_html(paths["html"], include_plotlyjs=True)
        return paths


def compare(device: dict, sim: dict, float_: dict | None, n_layers: int, tolerance: float = DEFAULT_TOLERANCE,
            device_full: dict | None = None, sim_full: dict | None = None, float_full: dict | None = None,
            order=None, max_tolerance: float | None = DEFAULT_MAX_TOLERANCE, views: dict | None = None,
            chunked: bool = False) -> NumericsReport:
    """The report from three captures ({op: summary}, and {op: array} where kept): device against the scheme's
    simulation, and the simulation against float, op by op in `order` (default: the simulation's). max_tolerance
    None: max_rel decides nothing. views: {op: _View} where an op is not the host's op of its name (a chunk's, a
    split's piece): its layer and kind are its host op's, and its row says "host_op", "chunk" (chunked) and "part"."""
    views = views or {}
    device_full, sim_full, float_full = device_full or {}, sim_full or {}, float_full or {}
    rows, first = [], None
    for name in order or list(sim):
        if name not in device or name not in sim:
            continue
        v = views.get(name)
        host = v.host if v is not None else name
        r = {"op": name, "layer": op_layer(host, n_layers), "kind": op_kind(host), "shape": device[name]["shape"],
             **({"host_op": host} if host != name else {}), **({"chunk": v.chunk} if chunked and v else {}),
             **({"part": {"rows": v.rows, "cols": v.cols}} if v is not None and (v.rows or v.cols) else {}),
             "nonfinite": device[name]["nonfinite"], "device": device[name], "sim": sim[name],
             "device_vs_sim": _distance(device[name], sim[name], device_full.get(name), sim_full.get(name))}
        if float_ is not None and name in float_:
            r["float"] = float_[name]
            r["scheme_vs_float"] = _distance(sim[name], float_[name], sim_full.get(name), float_full.get(name))
        d = r["device_vs_sim"]
        by = ("nonfinite" if r["nonfinite"] else "rel_l2" if d["rel_l2"] > tolerance else
              "max_rel" if max_tolerance is not None and d["max_rel"] > max_tolerance else None)
        if first is None and by:
            first = {"op": name, "layer": r["layer"], "kind": r["kind"], **d, "by": by,
                     **({"chunk": r["chunk"]} if "chunk" in r else {})}
        rows.append(r)
    return NumericsReport(rows, tolerance, first, max_tolerance=max_tolerance)


_CHUNKED = re.compile(r"c(\d+)\.(?:l(\d+)\.)?(.+)")   # a chunked prefill's op: c1.l3.attn_q, c1.embed
_PIECE = re.compile(r"(.+)\.(npu\d+|npucat|gpu|cat)")   # a HeteroLLM split's piece or join (graph.template._split)


@dataclass(frozen=True)
class _View:
    """Where a plan op's output sits in the host's capture: op `host` of chunk `chunk` (a chunked prefill's chunk;
    0 otherwise), its rows and columns [a, b) (None: all; a HeteroLLM split's piece holds a block of the linear's
    output)."""
    host: str
    chunk: int = 0
    rows: tuple | None = None
    cols: tuple | None = None

    def take(self, x: np.ndarray) -> np.ndarray:
        if self.rows is not None:
            x = x[self.rows[0]:self.rows[1]]
        return x if self.cols is None else x[:, self.cols[0]:self.cols[1]]


def _leaf_ops(ops) -> list:
    """A plan's op dicts with each fused op's sub-ops, at any depth, in its place (protocol.leaf_names' ops)."""
    out = []
    for op in ops:
        out += _leaf_ops(op["attrs"]["ops"]) if op["kind"] == "fused" else [op]
    return out


def _views(leaves: list) -> dict:
    """{plan op name: _View, or None where the host has no such value}. A chunked prefill's c{i}.l{l}.X is the host's
    blk.{l}.X in chunk i; a linear's join "<linear>.sum" is the linear; its int8 and shadow terms have no host value;
    a HeteroLLM piece (.npu{j}, .gpu, .npucat, .cat) is its block of the linear's output when the linear has no
    shadow (with one, the pieces split its int8 term alone), and the piece no other piece of the linear reads (the
    last join) is the whole linear."""
    names = {o["name"] for o in leaves}
    by = {o["name"]: o for o in leaves}
    readers: dict = {}
    for o in leaves:
        for i in o.get("inputs", []):
            if isinstance(i, dict) and "op" in i:
                readers.setdefault(i["op"], []).append(o["name"])

    def extent(op):
        if op["kind"] == "concat":
            parts = [extent(by[i["op"]]) for i in op["inputs"]]
            rows = [r for r, _ in parts if r is not None]
            cols = [c for _, c in parts if c is not None]
            return ((min(r[0] for r in rows), max(r[1] for r in rows)) if rows else None,
                    (min(c[0] for c in cols), max(c[1] for c in cols)) if cols else None)
        a = op.get("attrs", {})
        return (tuple(a["rows"]) if a.get("rows") else None, tuple(a["cols"]) if a.get("cols") else None)

    out = {}
    for op in leaves:
        name = op["name"]
        m = _CHUNKED.fullmatch(name)
        base = (f"blk.{m[2]}.{m[3]}" if m[2] else m[3]) if m else name
        rows = cols = None
        piece = _PIECE.fullmatch(name)
        if base.endswith(".sum"):
            host = base[:-4]
        elif base.endswith((".int8", ".shadow")):
            host = None
        elif piece:
            host = None if piece[1] + ".sum" in names else _PIECE.fullmatch(base)[1]
            last = not any((q := _PIECE.fullmatch(r)) and q[1] == piece[1] for r in readers.get(name, []))
            rows, cols = (None, None) if last else extent(op)
        else:
            host = base
        out[name] = None if host is None else _View(host, int(op.get("chunk") or 0), rows, cols)
    return out


class _Picked:
    """The ops a pattern picks from an agent plan's capture names, and where the host holds each: see _views. A
    pattern matches a plan op by its own name or by its host op's (so "blk.1.*" picks a chunked prefill's c0.l1.*,
    c1.l1.*, ... and a split linear's join). The report names an op by its host op where the plan computes that
    whole op once (a split linear's join "<linear>.sum" is the linear), else by its plan name."""

    def __init__(self, plan: dict, ops, what: str = "the plan"):
        self.leaves = _leaf_ops(plan["ops"])
        self.names, self.ops = [o["name"] for o in self.leaves], ops
        self.views = _views(self.leaves)
        pats = None if ops is None else [p.strip() for p in str(ops).split(",") if p.strip()]
        hit = lambda n: pats is None or any(fnmatch.fnmatchcase(x, p) for p in pats for x in
                                            (n, self.views[n].host if self.views[n] else n))
        self.picked = [n for n in self.names if hit(n)]
        if not self.picked:
            raise NumericsError(f"--numerics-ops {ops!r} names no op of {what} (ops are named like {self.names[1]!r}, "
                                f"'blk.1.*', 'lm_head')")
        self.chunked = any(v is not None and v.chunk for v in self.views.values())
        self.report, used = {}, set()
        for n in reversed(self.names):  # the last op computing a host op whole takes its name
            v = self.views[n]
            whole = v is not None and not self.chunked and v.rows is None and v.cols is None and v.host != n
            self.report[n] = v.host if whole and v.host not in used and v.host not in self.views else n
            used.add(self.report[n])
        self.joins = {n: r for n, r in self.report.items() if r != n}
        self.host_ops = ",".join(self.on_host(self.picked)) if self.joins else ops
        self.shapes = {o["name"]: o.get("shape") for o in self.leaves}

    def on_host(self, ns) -> list:
        return [self.report.get(n, n) for n in ns]

    def sizes(self) -> dict:
        """{report name: bytes of the op's float32 output} from the plan's shapes."""
        return {self.report[n]: int(np.prod(s)) * 4 for n, s in self.shapes.items() if s}

    def check_full(self, full, sizes: dict, limit_bytes: int, times: int = 1) -> int:
        """The bytes a full capture of `full` (plan op names) takes `times` over; refused naming an unknown op, or the
        size over the limit."""
        unknown = [n for n in full if n not in self.names]
        if unknown:
            raise NumericsError(f"full capture names {unknown[:3]}, which are not ops of the plan")
        need = times * sum(sizes.get(n, 0) for n in self.on_host(full))
        if need > limit_bytes:
            raise NumericsError(f"full capture of {len(full)} ops is {need} bytes ({need / 2**20:.1f} MiB), over the "
                                f"limit of {limit_bytes} bytes: capture fewer ops in full")
        return need

    def field(self, full, limit_bytes: int, fault: dict | None) -> dict:
        """The run request's numerics field: the picked ops by name (the agent matches plan names only)."""
        out = {"ops": None if self.ops is None else ",".join(self.picked), "full": list(full),
               "full_limit_bytes": int(limit_bytes)}
        if fault:
            out["fault"] = fault
        return out

    def order(self) -> list:
        """The picked ops' report names, chunk by chunk, each chunk in plan order (a dependency order: a plan runs
        an op after its inputs)."""
        idx = {n: i for i, n in enumerate(self.names)}
        key = lambda n: (self.views[n].chunk if self.views[n] else 0, idx[n])
        return [self.report[n] for n in sorted(self.picked, key=key)]


def _sizes(summaries: dict) -> dict:
    """{op: bytes of its float32 output} from the host's summaries."""
    return {n: int(np.prod(s["shape"])) * 4 for n, s in summaries.items()}


def _device_capture(dev, res, what: str = "numerics", need: int = 1) -> tuple[dict, list]:
    """The run reply's numerics map and full tensors; refused in one line where the agent did not capture, or
    captures at a version under `need` (edgeprobe_kernels.numerics.CAPTURE_VERSION)."""
    if res.numerics_raw is None:
        raise NumericsError(f"the agent (version {dev.info.get('agent_version')}) does not capture numerics: its run "
                            "reply has no 'numerics'; update the agent (edgeprobe agent) to one that does")
    got, got_full = res.numerics_raw
    if got.get("version", 1) < need:
        raise NumericsError(_too_old(dev, got.get("version", 1), need, what))
    return got, got_full


def _too_old(dev, version: int, need: int, what: str) -> str:
    return (f"the agent (version {dev.info.get('agent_version')}, numerics capture {version}) does not capture "
            f"{what} (capture {need} does); update the agent (edgeprobe agent)")


def _report(qm, pick: _Picked, dev_sum: dict, dev_full: dict, sim: dict, sim_arrays: dict, flt, flt_arrays,
            tolerance, max_tolerance) -> NumericsReport:
    """compare() at the plan's op order under the host's names, with the scheme's default tolerances."""
    tol, max_tol = tolerances(qm.scheme)
    return compare(dev_sum, sim, flt, qm.model.config.n_layers, tol if tolerance is None else tolerance, dev_full,
                   sim_arrays, flt_arrays, order=pick.on_host(pick.names),
                   max_tolerance=max_tol if max_tolerance is None else max_tolerance)


def prefill_numerics(dev, qm, tokens, ops=None, full=None, float_model=None, tolerance: float | None = None,
                     limit_bytes: int = MAX_FULL_BYTES, progress: bool = False, fault: dict | None = None,
                     max_tolerance: float | None = None):
    """A layer-by-layer prefill of `tokens` on `dev` with numerics captured at the ops `ops` picks (glob, None: all),
    and the host's captures -> the RunResult, with .numerics a NumericsReport. full: op names sent whole; None: every
    picked op when they fit `limit_bytes`, else none (the report then compares summaries). float_model: the float
    Model for scheme_vs_float (None: not computed). tolerance, max_tolerance: None gives the scheme's
    (`tolerances`). fault: TEST ONLY, {"op", "index", "codes"} (see
    edgeprobe_kernels.numerics.Capture). Raises NumericsError before running for a pattern naming no op, a full
    capture over the limit, and after it for an agent that does not capture. Any other plan (a chunked prefill, a
    HeteroLLM split): plan_numerics."""
    from .plan import prefill_plan

    tokens = np.asarray(tokens, np.int32)
    return plan_numerics(dev, qm, prefill_plan(qm.manifest, len(tokens)), tokens, ops, full, float_model, tolerance,
                         limit_bytes, progress, fault, max_tolerance, key=("prefill", len(tokens), "cpu"),
                         title=f"prefill {len(tokens)} tokens, {qm.scheme}, numerics captured")


def plan_numerics(dev, qm, plan: dict, tokens, ops=None, full=None, float_model=None, tolerance: float | None = None,
                  limit_bytes: int = MAX_FULL_BYTES, progress: bool = False, fault: dict | None = None,
                  max_tolerance: float | None = None, key=None, title: str | None = None):
    """prefill_numerics for any prefill plan of `qm` over `tokens` (int[T]): a layer-by-layer one, a chunked prefill
    (mllm-NPU §3.2; each chunk's ops against the host's same chunk through a KV cache: report names c{i}.l{l}.X, each
    row's "chunk" and "host_op"), a HeteroLLM split (§4.1; each piece against its block of the host's linear, rows'
    "part" {rows, cols}, the last join under the linear's name). key: the plan's cache key on the device (None: put
    it anew); title: the run's."""
    tokens = np.asarray(tokens, np.int32)
    pick = _Picked(plan, ops)
    sizes = pick.sizes()
    if full is None:
        full = pick.picked if sum(sizes.get(pick.report[n], 0) for n in pick.picked) <= limit_bytes else []
    else:
        pick.check_full(full, sizes, limit_bytes)
    plan_id = dev.plan_for(qm, key, lambda: plan, progress=progress) if key is not None else dev.put_plan(plan)
    kind = plan.get("meta", {}).get("kind", "prefill")
    title = title or f"{kind} {len(tokens)} tokens, {qm.scheme}, numerics captured"
    res = dev.run(plan_id, {"tokens": tokens}, title=title, numerics=pick.field(full, limit_bytes, fault))
    got, got_full = _device_capture(dev, res)
    dev_sum = {pick.report.get(s["op"], s["op"]): s for s in got["summaries"]}
    dev_full = dict(zip(pick.on_host(got["full"]), got_full))
    views = {n: pick.views[n] for n in pick.picked if pick.views[n] is not None}
    meta = plan.get("meta", {})
    step = int(meta["chunk"]) if meta.get("chunk") else len(tokens)
    chunks = [(s, min(s + step, len(tokens))) for s in range(0, len(tokens), step)]
    whole = set(full)
    sim, sim_arrays = _host_views(qm.model, tokens, chunks, views, whole, linear=qm.linear)
    flt, flt_arrays = _host_views(float_model, tokens, chunks, views, whole) if float_model is not None \
        else (None, {})
    rn = lambda d: {pick.report[n]: v for n, v in d.items()} if d is not None else None
    tol, max_tol = tolerances(qm.scheme)
    hosts = {pick.report[n]: v for n, v in views.items()}
    report = compare(dev_sum, rn(sim), rn(flt), qm.model.config.n_layers, tol if tolerance is None else tolerance,
                     dev_full, rn(sim_arrays), rn(flt_arrays), order=pick.order(),
                     max_tolerance=max_tol if max_tolerance is None else max_tolerance, views=hosts,
                     chunked=pick.chunked)
    report.meta = {"scheme": qm.scheme, "tokens": int(len(tokens)), "ops_captured": len(dev_sum),
                   "full_captured": len(dev_full), "full_bytes": int(got.get("full_bytes", 0)),
                   "agent": dev.info.get("agent_version"), "fault": fault, "plan": meta.get("kind", "prefill"),
                   **({"chunk": step, "chunks": len(chunks)} if pick.chunked else {})}
    renamed = {r: n for n, r in pick.joins.items()}
    for r in report.ops:  # a join reported under its linear's name says which op of the plan it is
        if r["op"] in renamed:
            r["device_op"] = renamed[r["op"]]
    report.device_full = dev_full
    res.numerics = report
    return res


def _host_views(model, tokens, chunks: list, views: dict, full: set, linear=None) -> tuple[dict, dict]:
    """The host's capture at plan ops' views (_View by plan op name): {op: summary}, {op: float32 array} for the ops in
    `full`; a prefill of `tokens` (int[T]) in `chunks` [(start, end)] through one KV cache, as a chunked prefill runs
    (one chunk: no cache, the layer-by-layer pass), with the caller's linear (a QuantizedModel's: the scheme's
    simulation; None: float)."""
    from .forward import KVCache, forward

    at: dict = {}
    for n, v in views.items():
        at.setdefault(v.chunk, {}).setdefault(v.host, []).append(n)
    summaries, arrays = {}, {}
    cache = KVCache(model.config) if len(chunks) > 1 else None
    for ci, (s, e) in enumerate(chunks):
        want = at.get(ci, {})
        if not want and cache is None:
            continue
        names = set(op_names(model.config, e - s, cache is not None))

        def seen(host, x, want=want):
            for n in want[host]:
                y = views[n].take(x)
                summaries[n] = summarize(y)
                if n in full:
                    arrays[n] = np.array(y, copy=True)

        forward(model, np.asarray(tokens[s:e], np.int64), cache=cache, hooks={h: seen for h in want if h in names},
                linear=linear, logits="last")
    return summaries, arrays


# ---- decode steps ------------------------------------------------------------------------------------------------
DECODE_FORMAT = "edgeprobe-numerics-decode/1"


@dataclass
class DecodeNumerics:
    """Per-op numerics of a decode session: `prefill` (the prompt's run in the session, a NumericsReport; None where
    the pattern picks none of its ops) and `steps`, one NumericsReport per decode step (meta: step, token, position),
    each against the host's references through their own KV caches (forward.KVCache) at the same positions.
    `first_divergent`: the first op that left the simulation, in run order, with its "phase" ("prefill" | "decode")
    and "step" (None for the prefill); None: none did."""
    prefill: NumericsReport | None
    steps: list
    tokens: np.ndarray                  # int32[steps]: the token each step was fed
    meta: dict = field(default_factory=dict)

    @property
    def first_divergent(self) -> dict | None:
        for rep in ([self.prefill] if self.prefill is not None else []) + self.steps:
            if rep.first_divergent is not None:
                return rep.first_divergent
        return None

    def to_json(self) -> dict:
        return {"format": DECODE_FORMAT, "first_divergent": self.first_divergent, **self.meta,
                "tokens": self.tokens.tolist(),
                "prefill": self.prefill.to_json() if self.prefill is not None else None,
                "steps": [r.to_json() for r in self.steps]}

    def figure(self):
        """Divergence by depth, step by step: the largest device-vs-simulation relative L2 per layer (x), one line per
        decode step (the prefill's too), scheme vs float dashed (a plotly Figure)."""
        import plotly.graph_objects as go

        fig = go.Figure()
        runs = ([("prefill", self.prefill)] if self.prefill is not None else []) + \
            [(f"step {r.meta['step']}", r) for r in self.steps]
        for dist, dash in (("device_vs_sim", "solid"), ("scheme_vs_float", "dash")):
            for label, rep in runs:
                worst: dict = {}
                for r in rep.ops:
                    if r.get(dist) and r[dist]["rel_l2"] >= worst.get(r["layer"], (-1.0, ""))[0]:
                        worst[r["layer"]] = (r[dist]["rel_l2"], r["op"])
                if not worst:
                    continue
                xs = sorted(worst)
                fig.add_trace(go.Scatter(x=xs, y=[max(worst[x][0], 1e-12) for x in xs], mode="lines+markers",
                                         name=f"{label} ({dist.replace('_', ' ')})", legendgroup=dist,
                                         line={"dash": dash}, customdata=[[worst[x][1]] for x in xs],
                                         hovertemplate="%{customdata[0]}<br>rel L2 %{y:.3g}<extra></extra>"))
        tol = self.steps[0].tolerance if self.steps else self.prefill.tolerance
        fig.add_hline(y=tol, line_dash="dot", annotation_text=f"tolerance {tol:g}")
        title = "divergence by depth per decode step: device vs simulation (solid), scheme vs float (dashed)"
        first = self.first_divergent
        if first:
            title += f"; first divergent op {first['op']} ({first['phase']}" + \
                (f" step {first['step']})" if first["step"] is not None else ")")
        fig.update_layout(title=title, xaxis_title="layer (-1: embed; last: output_norm, lm_head)",
                          yaxis_title="largest relative L2 error in the layer", yaxis_type="log",
                          template="plotly_white")
        return fig

    def write(self, out_dir) -> dict:
        """numerics.json and numerics.html (the figure, plotly.js inlined) -> their paths."""
        return NumericsReport.write(self, out_dir)


_SESSIONS = iter(range(1 << 62))  # each decode_numerics call opens its own session on the agent


def decode_numerics(dev, qm, tokens, steps: int = 3, step_tokens=None, ops=None, full=None, float_model=None,
                    tolerance: float | None = None, limit_bytes: int = MAX_FULL_BYTES, progress: bool = False,
                    fault: dict | None = None, max_tolerance: float | None = None, prefill: bool = True,
                    loop: str = "agent"):
    """A decode session on `dev` (a Device: its session() opens it): the prompt `tokens` (int[T]) prefilled, then
    `steps` decode steps, numerics captured at the ops `ops` picks (glob over a decode step's op names, the
    template's: embed, blk.{i}.attn_q, ..., lm_head; None: all) on every step (and on the prefill, unless
    prefill=False), and the host's captures through KV caches
    at the same positions -> the RunResult (outputs "logits" float32[steps, 1, vocab], "fed" int32[1, steps]), with
    .numerics a DecodeNumerics. step_tokens: int[steps] fed to the steps, one run each; None: greedy, the agent's
    decode loop (one run, each step fed the argmax of the last logits, the host following the tokens it fed). The
    host's references (the scheme's simulation; float_model's, if given) are fed the same tokens as the device.
    full, tolerance, max_tolerance, limit_bytes (for the whole session): as prefill_numerics. fault: TEST ONLY,
    {"op", "index", "codes", "step"}: with "step" k, only decode step k; without, the prefill and every step.
    loop (greedy, step_tokens None): "agent" (one run for every step) or "host" (one run a step, the host feeding the
    argmax of the device's last logits, as `edgeprobe run --decode-loop host` decodes)."""
    from .forward import KVCache, forward
    from .plan import one_lane_for, prefill_plan
    from .trace import Trace

    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if steps < 1:
        raise ValueError(f"steps (decode steps) must be >= 1, got {steps}")
    if loop not in ("agent", "host"):
        raise ValueError(f"loop must be 'agent' or 'host', got {loop!r}")
    if step_tokens is not None:
        step_tokens = np.asarray(step_tokens, np.int32).reshape(-1)
        if len(step_tokens) != steps:
            raise ValueError(f"step_tokens gives {len(step_tokens)} tokens for {steps} steps")
    have = dev.info.get("numerics", 1)
    if have < 2:
        raise NumericsError(_too_old(dev, have, 2, "numerics inside decode steps"))
    T = len(tokens)
    pre_plan = prefill_plan(qm.manifest, T, session=True)
    step_plan = prefill_plan(qm.manifest, 1, session=True, one_lane=one_lane_for(dev.info))
    step_pick = _Picked(step_plan, ops, "a decode step")
    pre_pick = None
    if prefill:
        try:
            pre_pick = _Picked(pre_plan, ops)
        except NumericsError:
            pre_pick = None  # the pattern names decode-only ops: the steps alone
    # the references' sizes first, so a full capture over the limit is refused before the device spends anything:
    # the prompt through the simulation's cache, and a decode step's shapes from one token at position 0
    sim_cache = KVCache(qm.model.config)
    pre_sim, pre_arrays = ({}, {}) if pre_pick is None else host_numerics(
        qm.model, tokens, pre_pick.host_ops, pre_pick.on_host(pre_pick.picked), linear=qm.linear, cache=sim_cache)
    if pre_pick is None:
        forward(qm.model, tokens, cache=sim_cache, linear=qm.linear, logits="none")
    shapes, _ = host_numerics(qm.model, [0], step_pick.host_ops, (), linear=qm.linear, cache=KVCache(qm.model.config))
    step_sizes = _sizes(shapes)
    if full is None:
        need = steps * sum(step_sizes.get(n, 0) for n in step_pick.on_host(step_pick.picked)) + \
            (sum(_sizes(pre_sim).values()) if pre_pick is not None else 0)
        step_full = step_pick.picked if need <= limit_bytes else []
        pre_full = pre_pick.picked if pre_pick is not None and need <= limit_bytes else []
    else:
        step_full = [n for n in full if n in step_pick.names]
        pre_full = [n for n in full if pre_pick is not None and n in pre_pick.names]
        unknown = [n for n in full if n not in step_pick.names and n not in (pre_pick.names if pre_pick else ())]
        if unknown:
            raise NumericsError(f"full capture names {unknown[:3]}, which are not ops of the plan")
        need = step_pick.check_full(step_full, step_sizes, limit_bytes, steps)
        if pre_pick is not None:
            pre_pick.check_full(pre_full, _sizes(pre_sim), limit_bytes - need)
    pre_arrays = {n: a for n, a in (pre_arrays or {}).items() if n in set(pre_pick.on_host(pre_full))} \
        if pre_pick is not None else {}

    # the Device's session (workflows.session): workflows runs plan_numerics, so this module does not import it
    sess = dev.session(qm, T + steps, name=f"numerics-{next(_SESSIONS)}", progress=progress)
    events, out_logits = [], []
    try:
        pre_fault = fault if fault and "step" not in fault else None
        pre_field = pre_pick.field(pre_full, limit_bytes, pre_fault) if pre_pick is not None else None
        r = dev.run(dev.put_plan(pre_plan), {"tokens": tokens}, title=f"prefill {T} tokens, numerics captured",
                    session=sess.name, advance=T, phase="prefill",
                    **({"numerics": pre_field} if pre_field is not None else {}))
        events += [{**e, "group": e["group"] if e["kind"] == "numerics" else "prefill"} for e in r.trace.events]
        pre_got = _device_capture(dev, r, "numerics inside decode steps", 2) if pre_field is not None else None
        step_id = dev.put_plan(step_plan)
        per_step = []  # (summaries, full names, full arrays) of each step
        if step_tokens is None and loop == "agent":  # one run; each summary and full tensor says its step
            first = np.argmax(r.logits.reshape(1, -1), axis=-1).astype(np.int32)
            r = dev.run(step_id, {"tokens": first}, title=f"decode steps 0..{steps - 1}, numerics captured",
                        session=sess.name, advance=1, phase="decode", steps=steps, keep="all",
                        numerics=step_pick.field(step_full, limit_bytes, fault))
            got, got_full = _device_capture(dev, r, "numerics inside decode steps", 2)
            fed = np.asarray(r.outputs["fed"]).reshape(-1)
            at = got.get("full_steps", [0] * len(got["full"]))
            for k in range(steps):
                per_step.append(([s for s in got["summaries"] if s.get("step") == k],
                                 [n for n, j in zip(got["full"], at) if j == k],
                                 [a for a, j in zip(got_full, at) if j == k]))
            out_logits = list(np.asarray(r.logits))
            events += [{**e, "group": e["group"] if e["kind"] == "numerics" else f"step{e.get('step', steps - 1)}"}
                       for e in r.trace.events]
        else:
            fed = step_tokens if step_tokens is not None else np.zeros(steps, np.int32)
            for k in range(steps):
                if step_tokens is None:  # the host's greedy loop: the argmax of the device's last logits
                    fed[k] = int(np.argmax(np.asarray(r.logits).reshape(-1)))
                f = None if not fault else fault if "step" not in fault else \
                    {a: b for a, b in fault.items() if a != "step"} if fault["step"] == k else None
                r = dev.run(step_id, {"tokens": fed[k:k + 1]}, title=f"decode step {k}, numerics captured",
                            session=sess.name, advance=1, phase="decode", numerics=step_pick.field(step_full,
                                                                                                 limit_bytes, f))
                got, got_full = _device_capture(dev, r, "numerics inside decode steps", 2)
                per_step.append((got["summaries"], got["full"], got_full))
                out_logits.append(r.logits.reshape(1, -1))
                events += [{**e, "step": k, "group": e["group"] if e["kind"] == "numerics" else f"step{k}"}
                           for e in r.trace.events]
    finally:
        sess.close()

    flt_cache = KVCache(float_model.config) if float_model is not None else None
    pre_rep = None
    if pre_pick is not None:
        got, got_full = pre_got
        flt, flt_arrays = host_numerics(float_model, tokens, pre_pick.host_ops, pre_pick.on_host(pre_full),
                                        cache=flt_cache) if float_model is not None else (None, {})
        dev_full = dict(zip(pre_pick.on_host(got["full"]), got_full))
        pre_rep = _report(qm, pre_pick, {pre_pick.joins.get(s["op"], s["op"]): s for s in got["summaries"]},
                          dev_full, pre_sim, pre_arrays, flt, flt_arrays, tolerance, max_tolerance)
        pre_rep.meta = {"phase": "prefill", "step": None, "tokens": T, "ops_captured": len(got["summaries"]),
                        "full_captured": len(dev_full)}
        pre_rep.device_full = dev_full
        _tag(pre_rep, "prefill", None)
    elif float_model is not None:
        forward(float_model, tokens, cache=flt_cache, logits="none")
    reps = []
    for k, (summ, full_names, full_arrays) in enumerate(per_step):
        tok = fed[k:k + 1]
        sim, sim_arrays = host_numerics(qm.model, tok, step_pick.host_ops, step_pick.on_host(step_full),
                                        linear=qm.linear, cache=sim_cache)
        flt, flt_arrays = host_numerics(float_model, tok, step_pick.host_ops, step_pick.on_host(step_full),
                                        cache=flt_cache) if float_model is not None else (None, {})
        dev_full = dict(zip(step_pick.on_host(full_names), full_arrays))
        rep = _report(qm, step_pick, {step_pick.joins.get(s["op"], s["op"]): s for s in summ}, dev_full, sim,
                      sim_arrays or {}, flt, flt_arrays or {}, tolerance, max_tolerance)
        rep.meta = {"phase": "decode", "step": k, "token": int(tok[0]), "position": T + k, "ops_captured": len(summ),
                    "full_captured": len(dev_full)}
        rep.device_full = dev_full
        _tag(rep, "decode", k)
        reps.append(rep)
    result = DecodeNumerics(pre_rep, reps, np.asarray(fed, np.int32),
                            {"scheme": qm.scheme, "prompt_tokens": T, "decode_steps": steps,
                             "loop": loop if step_tokens is None else "host",
                             "agent": dev.info.get("agent_version"), "fault": fault})
    from .client import RunResult

    res = RunResult({"logits": np.stack(out_logits), "fed": np.asarray(fed, np.int32).reshape(1, -1)},
                    Trace(events, {"title": f"decode {steps} steps after {T} tokens, {qm.scheme}, numerics captured",
                                   "agent": dev.info.get("agent_version"), "numerics": True}))
    res.numerics = result
    return res


def _tag(rep: NumericsReport, phase: str, step) -> None:
    """A decode session's report and its first divergent op say which run they are."""
    if rep.first_divergent is not None:
        rep.first_divergent = {**rep.first_divergent, "phase": phase, "step": step}
