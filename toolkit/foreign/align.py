"""An imported trace's ops matched to the one model template (graph.template.model_ops) of the model it ran.

Each imported event is mapped to template op names by, in turn: its op type (MUL_MAT, fused MUL_MAT+MUL_MAT, ..+ADD,
SWIGLU, FLASH_ATTN_EXT, ROPE, RMS_NORM), the tensor names it carries (llama.cpp's `blk.0.attn_q.weight`,
`Qcur-0`, a role "ffn_gate"; GGUF names are the template's, kernels/names.py), its layer, the weight's shape
(ggml ne0:ne1 = [in, out] against the template's [out, in]) and the order of the layer's norms. What maps nowhere
stays in the trace, its kind kept, tagged unmatched with the reason.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from edgeprobe_kernels import names as N

from ..trace import Trace
from .base import ForeignTraceError

_LINEAR = re.compile(r"(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)(?![a-z_])")
# llama.cpp graph tensor -> the linear making it
_GGML_NAMES = {"Qcur": "attn_q", "Kcur": "attn_k", "Vcur": "attn_v", "attn_out-": "attn_output", "ffn_out-": "ffn_down"}


def model_config(model) -> dict:
    """The template's config from a ModelConfig, a dict of its fields, a config.json, an HF folder or a GGUF file."""
    from ..models import ModelConfig

    if isinstance(model, ModelConfig):
        return dataclasses.asdict(model)
    if isinstance(model, dict):
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        return dataclasses.asdict(ModelConfig(**{k: v for k, v in model.items() if k in known}))
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json":
        from ..models.hf_loader import config_from_hf

        return dataclasses.asdict(config_from_hf(json.loads(p.read_text()), p.parent))
    from ..models.gguf_loader import config_from_gguf, open_reader

    return dataclasses.asdict(config_from_gguf(open_reader(p), p))


@dataclass
class Alignment:
    """trace: the imported events, each with template_ops (names) or unmatched (reason); ops: the template."""
    trace: Trace
    ops: list
    matched_us: float
    total_us: float
    by_kind: dict = field(default_factory=dict)   # kind -> {"matched_us", "unmatched_us", "events"}

    @property
    def share(self) -> float:
        """Share of the imported time (sum of event durations) on events mapped to template ops."""
        return self.matched_us / self.total_us if self.total_us else 0.0

    def samples(self) -> list[dict]:
        """One fitting sample per matched event: lane, cost kind, FLOPs and bytes of its template ops, µs, layer,
        token rows (the event's own, else the template's) and kernel name."""
        tokens = self.trace.meta.get("aligned_to", {}).get("tokens")
        out = []
        for e in self.trace.events:
            if not e.get("template_ops"):
                continue
            costs = e.get("template_costs") or [self._op[n]["cost"] for n in e["template_ops"]]
            kind = max(costs, key=lambda c: c[1])[0]
            out.append({"lane": e["lane"], "kind": kind, "flops": sum(c[1] for c in costs),
                        "bytes": sum(c[2] for c in costs), "us": e["end_us"] - e["start_us"], "layer": e["layer"],
                        "op": e["kind"], "template_ops": list(e["template_ops"]), "pass": e.get("pass", 0),
                        "rows": int(rows) if (rows := e.get("rows") or tokens) else None, "kernel": e.get("kernel")})
        return out

    def __post_init__(self):
        self._op = {o["name"]: o for o in self.ops}


def _text(e: dict) -> str:
    parts = [e.get("name", ""), e.get("output", ""), e.get("tensors", "")] + list(e.get("inputs", []))
    return " ".join(str(p) for p in parts if p)


def _linear(e: dict) -> str | None:
    t = _text(e)
    m = _LINEAR.search(t)
    if m:
        return m[1]
    for ggml, lin in _GGML_NAMES.items():
        if ggml in t:
            return lin
    return None


def _head(e: dict) -> bool:
    """The LM head's matmul: llama.cpp's `result_output` tensor, or the `output.weight` it reads."""
    t = _text(e)
    return e["kind"].startswith("MUL_MAT") and bool("result_output" in t or re.search(r"(?<![.\w])output\.weight", t))


def _candidates(e: dict, done: set, layer: int) -> tuple[list, str | None]:
    """Template op suffixes (in the layer) this event computes, or ([], reason)."""
    kind, t = e["kind"], _text(e)
    parts = kind.split("+")
    if parts[0] in ("MUL_MAT", "MUL_MAT_ID"):
        lin = _linear(e)
        if lin is None:
            return [], "matmul of a weight the template does not have"
        n = parts.count("MUL_MAT")
        group = {2: {"ffn_gate": ["ffn_gate", "ffn_up"], "ffn_up": ["ffn_gate", "ffn_up"]},
                 3: dict.fromkeys(N.ATTN_IN, list(N.ATTN_IN))}.get(n, {}).get(lin, [lin] if n == 1 else None)
        if group is None:
            return [], f"{n} fused matmuls around {lin}"
        if "ADD" in parts[1:]:
            group = group + [{"ffn_down": "ffn_residual", "attn_output": "attn_residual"}.get(lin, "?")]
        return group, None
    if parts[0] in ("SWIGLU", "GEGLU"):
        return [parts[0].lower()], None
    if parts[0] in ("FLASH_ATTN_EXT",):
        return ["attention"], None
    q = "Qcur" in t or "q_layernorm" in t or "q_norm" in t
    k = "Kcur" in t or "k_layernorm" in t or "k_norm" in t
    if parts[0] == "ROPE" and (q or k):
        return ["rope_q" if q else "rope_k"], None
    if parts[0] == "RMS_NORM":
        if q or k:
            return ["q_norm" if q else "k_norm"], None
        named = next((s for s in ("attn_norm", "ffn_norm") if s in t), None)  # llama.cpp's `ffn_norm-0`
        if named:
            return [named], None
        nxt = next((s for s in ("attn_norm", "ffn_norm") if f"blk.{layer}.{s}" not in done), None)
        return ([nxt], None) if nxt else ([], "a third norm in the layer")
    return [], f"op type {kind} has no template op"


def _shape_ok(e: dict, suffixes: list, ops: dict, layer: int) -> str | None:
    """None if the event's weight shape (ggml [in, out]) is the template linear's [out, in] reversed, else why not."""
    shapes = e.get("input_shapes") or []
    lin = _linear(e)  # the first source is the weight the event is named by (a fused op's role)
    lin = lin if lin in suffixes else next((s for s in suffixes if s in N.ATTN_LINEARS + N.FFN_LINEARS), None)
    if lin is None or not shapes or len(shapes[0]) < 2:
        return None
    rec = ops[f"blk.{layer}.{lin}"]["attrs"].get("rec", {})
    out_in = rec.get("shape")
    if out_in and [shapes[0][0], shapes[0][1]] != [out_in[1], out_in[0]]:
        return f"weight {shapes[0][0]}:{shapes[0][1]} but the template's {lin} is [in {out_in[1]}, out {out_in[0]}]"
    return None


def align(trace: Trace, model, tokens: int | None = None) -> Alignment:
    """Match `trace`'s events to the template ops of `model` (see model_config) run over `tokens` rows (default: the
    activation rows of the trace's first matmul). An event that says its own rows (`rows`: a CSV of passes of
    several lengths) is priced by the template over those rows (template_costs). Returns an Alignment with a copy of
    the trace whose events carry template_ops and group (the template's subgraph, as Trace.compare matches) or
    unmatched (the reason)."""
    from ..graph.template import Weights, model_ops

    cfg = model_config(model)
    if tokens is None:
        mm = next((e for e in trace.events if e["kind"].startswith("MUL_MAT") and len(e.get("input_shapes", [])) > 1),
                  None)
        rows = next((e["rows"] for e in trace.events if e["kind"].startswith("MUL_MAT") and e.get("rows")), 1)
        tokens = int(mm["input_shapes"][1][1]) if mm else int(rows)
    weights = Weights(cfg, shadow=False, floats=True)
    ops = model_ops(weights, tokens)
    at_rows = {tokens: {o["name"]: o for o in ops}}
    by_name = {o["name"]: o for o in ops}
    index = {o["name"]: i for i, o in enumerate(ops)}
    events = copy.deepcopy(trace.events)
    done: set = set()
    matched_us = total_us = 0.0
    last, passes = -1, 0
    by_kind: dict = {}
    for e in events:
        dur = e["end_us"] - e["start_us"]
        total_us += dur
        layer = e.get("layer", -1)
        reason = None
        if _head(e):
            sfx, names = [], ["lm_head"]
        elif layer is None or layer < 0 or layer >= cfg["n_layers"]:
            sfx, reason, names = [], "no layer of the model", []
        else:
            sfx, reason = _candidates(e, done, layer)
            names = [f"blk.{layer}.{s}" for s in sfx]
        if not reason:
            missing = [n for n in names if n not in by_name]
            reason = (f"the template has no {', '.join(missing)}" if missing
                      else _shape_ok(e, sfx, by_name, layer) if sfx else None)
        r = int(e.get("rows") or tokens)
        if not reason and r != tokens and r not in at_rows:
            at_rows[r] = {o["name"]: o for o in model_ops(weights, r)}
        if not reason and e.get("rows"):
            other = next((n for n in names if at_rows[r][n]["shape"][0] != r), None)
            if other:  # e.g. the template's LM head takes the last row only; a draft model's takes every row
                reason = f"the template computes {other} on {at_rows[r][other]['shape'][0]} rows, the trace on {r}"
        k = by_kind.setdefault(e["kind"], {"matched_us": 0.0, "unmatched_us": 0.0, "events": 0})
        k["events"] += 1
        if reason:
            e["unmatched"] = reason
            k["unmatched_us"] += dur
            continue
        first = min(index[n] for n in names)
        if first < last and any(n in done for n in names):
            passes, done = passes + 1, set()  # the template again: the next forward pass of the trace
        last = max(index[n] for n in names)
        done.update(names)
        e["template_ops"] = names
        e["group"] = by_name[names[0]]["group"]
        if r != tokens:
            e["template_costs"] = [list(at_rows[r][n]["cost"]) for n in names]
        e["pass"] = passes
        matched_us += dur
        k["matched_us"] += dur
    if not total_us:
        raise ForeignTraceError(trace.meta.get("path", "trace"), "events", "no time to align", "a non-empty trace")
    meta = {**trace.meta, "aligned_to": {"config": cfg, "tokens": tokens, "share": matched_us / total_us}}
    return Alignment(Trace(events, meta), ops, matched_us, total_us, by_kind)
