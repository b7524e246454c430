"""The `fused` op: a run of one lane's consecutive ops computed back to back as one op (a decode step's layer), and
the step op (a whole decode step, each sub-op its own trace event). check_fused refuses a malformed one before a
plan runs.
"""
from __future__ import annotations

from time import perf_counter_ns

import numpy as np

from edgeprobe_kernels.linear_records import W8A8_SCHEMES, scheme_of
from edgeprobe_kernels.names import layer_of
from edgeprobe_kernels.numerics import CaptureError

from . import compiled
from .linear import group_linear, runner
from .registry import OPS, OpError, bytes_in, flops, op


def _sibling_groups(subs: list) -> list:
    """A fused op's sub-ops as steps: a sub-op alone, or a list of consecutive W8A8 linears that read the same
    input (q, k, v; gate, up), which a decode step computes in one call (linear.group_linear)."""
    steps, i = [], 0
    while i < len(subs):
        j = i + 1
        if _groupable(subs[i]):
            K = subs[i]["attrs"]["rec"]["shape"][1]
            while j < len(subs) and _groupable(subs[j]) and subs[j]["inputs"] == subs[i]["inputs"] \
                    and subs[j]["attrs"]["rec"]["shape"][1] == K:
                j += 1
        steps.append(subs[i:j] if j - i > 1 else subs[i])
        i = j
    return steps


def _groupable(sub: dict) -> bool:
    a = sub.get("attrs", {})
    rec = a.get("rec")
    return sub["kind"] == "linear" and isinstance(rec, dict) and scheme_of(rec) in W8A8_SCHEMES \
        and a.get("part", "all") == "all" and not any(k in a for k in ("rows", "cols", "pad_to")) \
        and isinstance(rec.get("shape"), list) and len(rec["shape"]) == 2 and len(sub.get("inputs", [])) == 1


def _plain_linear(sub: dict) -> bool:
    """A sub-op that is a whole linear with no split (a decode step's o and down projections): op_fused calls its
    cached runner directly, without op_linear's per-call lookups."""
    a = sub.get("attrs", {})
    return sub["kind"] == "linear" and isinstance(a.get("rec"), dict) and a.get("part", "all") == "all" \
        and not any(k in a for k in ("rows", "cols", "pad_to")) and len(sub.get("inputs", [])) == 1


def _compile_fused(attrs: dict) -> tuple[list, bool, dict | None, dict]:
    """attrs ops as steps: (a list of sibling linears or None, [(sub-op, its input refs as ("arg", i) | ("op", name),
    whether it is a plain linear)]), whether the op is a step op (has fused sub-ops: each sub-op its own event), the
    compiled layer it is (compiled.match) or None, and a step op's runs of compiled layers (compiled.layer_runs)."""
    steps = []
    step_op = any(s["kind"] == "fused" for s in attrs["ops"])
    for step in ([s] for s in attrs["ops"]) if step_op else _sibling_groups(attrs["ops"]):
        subs = step if isinstance(step, list) else [step]
        steps.append((step if isinstance(step, list) and not step_op else None,
                      [(sub, [("arg", r["arg"]) if "arg" in r else ("op", r["op"]) for r in sub["inputs"]],
                        _plain_linear(sub)) for sub in subs]))
    if step_op:
        return steps, step_op, None, compiled.layer_runs(attrs["ops"])
    return steps, step_op, compiled.match(attrs), {}


@op("fused")
def op_fused(inp, attrs, ctx):
    """One lane's consecutive ops computed back to back as one op: a decode step's layer, whose ~15 ops cost more in
    hand-offs than in arithmetic. attrs ops: [{"name", "kind", "inputs": [{"arg": i} | {"op": an earlier sub-op}],
    "attrs"}]; the value is the last sub-op's; the event gets the summed flops and parts_us (time per sub-op kind).
    With fused sub-ops (one level deep) it is a step op, a whole decode step in one dispatch, each sub-op timed
    here as its own event (ctx.event["sub_events"], emitted by the executor in place of this op's). A numerics capture
    (ctx.numerics) takes each sub-op it names as it is computed (_captured), before any later sub-op reads it."""
    local, parts, total = {}, {}, 0
    cap = ctx.numerics
    nested = []
    hvx = ctx.lane == "npu" and ctx.backends.get("npu") == "hvx"
    runners = ctx.runners
    steps, step_op, layer, runs = runners.per_object(attrs, "steps", _compile_fused)
    fast = compiled.ENABLED and cap is None and not hvx and ctx.lane != "gpu"
    if layer is not None and fast:
        out = compiled.run(layer, inp, ctx)  # a decode layer as one compiled call, or None: the sub-ops below
        if out is not None:
            return out
    t = perf_counter_ns()
    past = 0
    for si, (group, subs) in enumerate(steps):
        if si < past:  # a layer of the compiled run just computed
            continue
        if si in runs and fast:  # a step's consecutive layers as one compiled call, each with its own event
            run = runs[si]
            out = compiled.run_layers(run, inp, local, ctx, nested)
            if out is not None:
                total += sum(ev["flops"] for ev in nested[len(nested) - len(run["ms"]):])
                local[run["subs"][-1]["name"]] = out
                t1 = perf_counter_ns()
                parts["fused"] = parts.get("fused", 0.0) + (t1 - t) / 1000.0
                t, past = t1, run["end"]
                continue
        if group is not None:
            src, i = subs[0][1][0]
            x = inp[i] if src == "arg" else local[i]
            outs = group_linear(group, x, ctx)
            if outs is not None:
                for sub, out in zip(group, outs):
                    if cap is not None and sub["name"] in cap.ops:
                        out = _captured(ctx, sub["name"], out)
                    local[sub["name"]] = out
                    total += 2 * x.shape[0] * x.shape[1] * out.shape[1]
                t1 = perf_counter_ns()
                parts["linear"] = parts.get("linear", 0.0) + (t1 - t) / 1000.0
                t = t1
                continue
        for sub, rr, plain in subs:
            args = [inp[i] if src == "arg" else local[i] for src, i in rr]
            kind, a = sub["kind"], sub.get("attrs", {})
            if step_op:
                out = _own_event(sub, args, ctx, nested, plain and not hvx)
                total += nested[-1].get("flops", 0)
            else:
                out = _sub_value(sub, args, ctx, plain and not hvx)
                # a plain linear's flops without flops()'s lookups (60 of them a decode step)
                total += (2 * args[0].shape[0] * args[0].shape[1] * out.shape[1] if plain
                          else flops(kind, args, out, a, ctx))
            if cap is not None and sub["name"] in cap.ops:
                out = _captured(ctx, sub["name"], out)
            local[sub["name"]] = out
            t1 = perf_counter_ns()
            parts[kind] = parts.get(kind, 0.0) + (t1 - t) / 1000.0
            t = t1
    if ctx.event is not None:
        ctx.event.update({"flops": int(total), "parts_us": parts, "fused_ops": len(attrs["ops"])})
        if nested:
            ctx.event["sub_events"] = nested
    return out


def _captured(ctx, name: str, out):
    """Sub-op `name`'s output through the run's numerics capture (the test-only fault may change it) -> the output;
    its "numerics:<op>" event, on the fused op's lane after the sub-op's, goes to ctx.captured for the executor."""
    t0 = perf_counter_ns()
    try:
        out = ctx.numerics.take(name, out)
    except CaptureError as e:  # a full tensor over the limit
        raise OpError(e.code, str(e)) from None
    if ctx.captured is not None:
        fixed = ctx.sub_event or {}
        layer = layer_of(name) if name.startswith("blk.") else -1
        ctx.captured.append({"name": f"numerics:{name}", "kind": "numerics", "lane": fixed.get("lane", ctx.lane),
                             "layer": layer, "chunk": fixed.get("chunk", 0), "deps": [name],
                             "group": f"numerics:blk.{layer}" if layer >= 0 else f"numerics:{name}",
                             "start_us": t0 / 1000.0, "end_us": perf_counter_ns() / 1000.0,
                             "bytes_in": int(out.nbytes), "bytes_out": 0, "flops": 0, "emulated": False})
    return out


def _sub_value(sub: dict, args: list, ctx, plain: bool):
    """A fused op's sub-op computed: a plain linear (plain: not on the hvx backend) through its runner, looked up once
    per lane, except on the gpu lane (op_linear picks its OpenCL kernel); any other sub-op through its op."""
    if plain and ctx.lane != "gpu" and isinstance(args[0], np.ndarray) and args[0].ndim == 2:
        fn = ctx.runners.per_object(sub, ctx.lane, lambda s: runner(ctx, s["attrs"]["rec"], "all"))
        return fn(args[0], counters=ctx.counters)
    return OPS[sub["kind"]](args, sub.get("attrs", {}), ctx)


def _own_event(sub: dict, args: list, ctx, events: list, plain: bool):
    """A sub-op of a step op (a fused layer, or an op around the layers: embed, final norm, head), run and timed,
    its trace event appended to events with the fields the executor gives a dispatched op."""
    outer, ctx.event = ctx.event, {}
    kind, a = sub["kind"], sub.get("attrs", {})
    t0 = perf_counter_ns()
    try:
        out = op_fused(args, a, ctx) if kind == "fused" else _sub_value(sub, args, ctx, plain)
    finally:
        t1 = perf_counter_ns()
        own, ctx.event = ctx.event, outer
    ev = {**(ctx.sub_event or {}), "name": sub["name"], "kind": kind, "layer": sub.get("layer", -1),
          "deps": sub.get("deps", []), "group": sub["name"], "start_us": t0 / 1000.0, "end_us": t1 / 1000.0,
          "bytes_in": bytes_in(args), "bytes_out": out.nbytes, "shape": list(out.shape)}
    if kind != "fused":
        ev["flops"] = int(flops(kind, args, out, a, ctx))
    ev.update(own)  # the op's own fields win, as the executor merges them
    events.append(ev)
    return out


def check_fused(name: str, attrs: dict, n_inputs: int, nested: bool = False) -> None:
    """Refuse a malformed fused op before the plan runs (called by the executor's validate). Its sub-ops may be
    fused ops themselves, one level deep (a step op, op_fused)."""
    subs = attrs.get("ops")
    if not isinstance(subs, list) or not subs:
        raise OpError("bad_attrs", f"fused op {name!r} needs a non-empty list attrs.ops")
    seen = set()
    step_op = any(isinstance(sub, dict) and sub.get("kind") == "fused" for sub in subs)
    for i, sub in enumerate(subs):
        if not isinstance(sub, dict) or not isinstance(sub.get("name"), str) or sub.get("kind") not in OPS \
                or (sub["kind"] == "fused" and nested) or not isinstance(sub.get("inputs", []), list) \
                or not isinstance(sub.get("attrs", {}), dict):
            raise OpError("bad_attrs", f"fused op {name!r}: sub-op #{i} needs a name, a kind this agent runs (a "
                                       "fused op only one level deep), a list of inputs and a map of attrs")
        for r in sub.get("inputs", []):
            ok = isinstance(r, dict) and len(r) == 1 and (
                ("arg" in r and isinstance(r["arg"], int) and 0 <= r["arg"] < n_inputs) or r.get("op") in seen)
            if not ok:
                raise OpError("bad_attrs", f"fused op {name!r}: sub-op {sub['name']!r} input {str(r)[:40]} must be "
                                           f"{{'arg': i < {n_inputs}}} or {{'op': an earlier sub-op}}")
        if step_op and (not isinstance(sub.get("layer", -1), int) or isinstance(sub.get("layer", -1), bool)
                        or not isinstance(sub.get("deps", []), list)
                        or not all(isinstance(d, str) for d in sub.get("deps", []))):
            raise OpError("bad_attrs", f"fused op {name!r}: sub-op {sub['name']!r} of a step op (one with fused "
                                       "sub-ops, each sub-op its own event) has an int layer and a list of names as "
                                       "deps, if any")
        if sub["kind"] == "fused":
            check_fused(f"{name}/{sub['name']}", sub.get("attrs", {}), len(sub.get("inputs", [])), nested=True)
        seen.add(sub["name"])
