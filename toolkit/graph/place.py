"""Placement: the template's ops on lanes, in an order — a Plan, pure data the agent (or the host) runs.

Two policies, both over the same ops (graph.template):
    by kind   layer by layer (mllm-NPU §3.3's CPU/NPU split): integer GEMMs and NPU-format linears on `npu`,
              shadow-outlier GEMMs and every float op on `cpu` (float linears on `float_lane`), so the lanes
              overlap wherever the data edges allow; decode steps and batches too.
    by stage  chunked prefill (§3.2, §3.4): every op of a subgraph on that subgraph's lane, each lane running
              its subgraphs in the order a schedule starts them.
A split's pieces (HeteroLLM) keep the lanes the template pinned.
"""
from __future__ import annotations

from edgeprobe_kernels.linear_records import W8A8_SCHEMES, scheme_of

from .template import NPU_KINDS, GraphError

DEFAULT_STAGE_LANES = {"qkv": "npu", "shadow": "cpu", "attn": "cpu", "ffn": "npu"}


def lane_by_kind(op: dict, float_lane: str = "cpu", decode: bool = False) -> str:
    """decode: a decode step of mllm-NPU's int8 schemes runs on the CPU (its decoding backend); the NPU TTS
    paper's q4_0-tile decodes on the NPU."""
    if op.get("lane"):
        return op["lane"]
    if op["kind"] != "linear":
        return "cpu"
    part = op["attrs"].get("part", "all")
    kind = scheme_of(op["attrs"]["rec"])
    if part == "shadow" or (decode and kind in W8A8_SCHEMES):
        return "cpu"
    return "npu" if kind in NPU_KINDS else float_lane


def place_by_kind(ops: list, float_lane: str = "cpu", meta: dict | None = None, decode: bool = False) -> dict:
    """A layer-by-layer plan: lanes by op kind, each lane in program order. Ungrouped (group = op)."""
    out = []
    for op in ops:
        o = {k: v for k, v in op.items() if k != "group"}
        o["lane"] = lane_by_kind(op, float_lane, decode)
        out.append(o)
    return {"ops": out, "outputs": [ops[-1]["name"]], "meta": dict(meta or {})}


def place_by_stage(ops: list, lanes: dict | None = None) -> list:
    """Every op on its stage's lane (lanes: stage -> lane over DEFAULT_STAGE_LANES)."""
    lanes = {**DEFAULT_STAGE_LANES, **(lanes or {})}
    out = []
    for op in ops:
        if op.get("lane"):
            raise GraphError(f"op {op['name']} is pinned to a lane (a HeteroLLM split); chunked plans place by stage")
        out.append({**op, "lane": lanes[op["stage"]]})
    return out


def order_by_schedule(ops: list, slots: dict, meta: dict | None = None) -> dict:
    """A chunked plan: each lane runs its ops subgraph by subgraph in the order `slots` (group -> (lane, start,
    end)) starts them; within a subgraph, in program order. Every op's group must be scheduled on its lane."""
    missing = sorted({op["group"] for op in ops} - set(slots))
    if missing:
        raise GraphError(f"the schedule has no slot for subgraph {missing[0]} (and {len(missing) - 1} more): it was "
                         "built for another graph (e.g. other shadow-outlier layers); schedule this model's graph")
    for op in ops:
        if slots[op["group"]][0] != op["lane"]:
            raise GraphError(f"op {op['name']} is on lane {op['lane']} but the schedule runs {op['group']} on "
                             f"{slots[op['group']][0]}")
    rank = {g: (s[1], g) for g, s in slots.items()}
    seq = sorted(range(len(ops)), key=lambda i: (rank[ops[i]["group"]], i))
    placed = [ops[i] for i in seq]
    lane_order: dict = {}
    for op in placed:
        lane_order.setdefault(op["lane"], []).append(op["name"])
    return {"ops": placed, "lane_order": lane_order, "outputs": [ops[-1]["name"]], "meta": dict(meta or {})}


STEP_KINDS = {"embed", "rms_norm", "rope", "add", "attention", "swiglu", "linear", "lm_head"}  # a dense decode step


def step_on_one_lane(plan: dict, lane: str = "npu") -> dict:
    """A decode step whose linears all sit on `lane` (q4_0-tile on the npu lane) with every op of it moved there:
    the NPU test-time scaling paper runs the whole model on the NPU (§3), and a step split between lanes pays a
    cross-lane hand-off every few ops (~330 a step: its linears on npu, norms, RoPE and attention on cpu). Other
    plans (mllm-NPU's int8 decode on cpu, MoE or flash-streamed layers, pinned splits) come back as they are."""
    ops = plan["ops"]
    linears = [op for op in ops if op["kind"] == "linear"]
    if not linears or any(op["lane"] != lane for op in linears) \
            or any(op["kind"] not in STEP_KINDS or op["lane"] not in ("cpu", lane) for op in ops):
        return plan
    return {**plan, "ops": [{**op, "lane": lane} for op in ops], "meta": {**plan.get("meta", {}), "step_lane": lane}}


UNFUSED = {"embed", "lm_head", "moe_ffn", "ffn_flash"}  # their own events: inputs, outputs and flash reads


def fuse_layers(plan: dict, lanes=("cpu",)) -> dict:
    """Each layer's run of consecutive ops on one lane becomes one `fused` op named blk.{layer}, computed back to
    back on the agent (ops.op_fused): a decode step's ~15 ops per layer cost more in hand-offs than in arithmetic.
    A run is fused only when nothing outside it reads any op of it but its last (one value leaves the layer)."""
    ops = plan["ops"]
    if plan.get("lane_order"):
        raise GraphError("fuse_layers fuses plans that run in program order (placed by kind)")
    readers = _readers(ops)
    runs, cur = [], []
    for op in ops:
        key = (op["lane"], op.get("layer", -1))
        if cur and key == (cur[0]["lane"], cur[0].get("layer", -1)) and op["kind"] not in UNFUSED:
            cur.append(op)
            continue
        runs.append(cur)
        cur = [op] if op["lane"] in lanes and op.get("layer", -1) >= 0 and op["kind"] not in UNFUSED else []
        if not cur:
            runs.append([op])
    runs.append(cur)
    out, renamed = [], {}
    for run in filter(None, runs):
        names = {o["name"] for o in run}
        leaving = [o["name"] for o in run if readers.get(o["name"], set()) - names or o["name"] in plan["outputs"]]
        if len(run) < 2 or leaving != [run[-1]["name"]]:
            out.extend(run)
            continue
        out.append(_fuse_run(run, f"blk.{run[0]['layer']}"))
        renamed[run[-1]["name"]] = out[-1]["name"]
    return _renamed(plan, out, renamed, {**plan.get("meta", {}), "fused": True})


AROUND_LAYERS = {"embed", "rms_norm", "lm_head"}  # a decode step's ops before and after its layers


def fuse_step(plan: dict) -> dict:
    """A decode step as one op. Where the whole plan is one lane's chain of fused layers and the ops around them
    (AROUND_LAYERS: embedding, final norm, head), it becomes one fused op `step` whose sub-ops are those ops, the
    layers still fused (ops.op_fused, one level deep); else consecutive `fused` layers on one lane, each read by the
    next alone, become one fused op named blk.{first}-{last}. Either way the step dispatches one op (or 3) instead
    of one per layer (~14 us of Python each on 2 cores with the caches swept by the weights; ~40 us each for the
    embedding and the final norm, which also resolve their inputs), and each sub-op keeps its trace event, timed
    inside, with the deps the executor would have given it."""
    ops = plan["ops"]
    if len(ops) > 2 and len({op["lane"] for op in ops}) == 1 and plan["outputs"] == [ops[-1]["name"]] \
            and any(op["kind"] == "fused" for op in ops) \
            and all(op["kind"] == "fused" or op["kind"] in AROUND_LAYERS for op in ops):
        step = _fuse_run(ops, "step", _layer_event)
        return _renamed(plan, [step], {ops[-1]["name"]: "step"}, plan.get("meta", {}))
    readers = _readers(ops)
    runs, cur = [], []
    for op in ops:
        if op["kind"] == "fused" and cur and cur[-1]["kind"] == "fused" and op["lane"] == cur[-1]["lane"] \
                and readers.get(cur[-1]["name"], set()) == {op["name"]} and cur[-1]["name"] not in plan["outputs"]:
            cur.append(op)
            continue
        runs.append(cur)
        cur = [op]
    runs.append(cur)
    out, renamed = [], {}
    for run in filter(None, runs):
        if len(run) < 2:
            out.extend(run)
            continue
        out.append(_fuse_run(run, f"blk.{run[0].get('layer', 0)}-{run[-1].get('layer', 0)}", _layer_event))
        renamed[run[-1]["name"]] = out[-1]["name"]
    return _renamed(plan, out, renamed, plan.get("meta", {}))


def _layer_event(op: dict) -> dict:
    """What a fused layer's own event says beside its name: its layer, and the deps the executor gives an op."""
    return {"layer": op.get("layer", -1),
            "deps": sorted({r["op"] for r in op.get("inputs", []) if "op" in r} | set(op.get("deps", [])))}


def _readers(ops: list) -> dict:
    """op name -> the names of the ops that read its output or wait for it."""
    readers: dict = {}
    for op in ops:
        for r in op.get("inputs", []):
            if "op" in r:
                readers.setdefault(r["op"], set()).add(op["name"])
        for d in op.get("deps", []):
            readers.setdefault(d, set()).add(op["name"])
    return readers


def _fuse_run(run: list, name: str, more=lambda op: {}) -> dict:
    """The fused op `name` computing `run` (consecutive ops of one lane) back to back: its inputs are what the run
    reads from outside (each once), its sub-ops the run's ops reading them as {"arg": i}; more(op): fields added
    to op's sub-op."""
    names = {o["name"] for o in run}
    args, index, subs, deps = [], {}, [], set()
    for o in run:
        refs = []
        for r in o.get("inputs", []):
            if r.get("op") in names:
                refs.append(r)
            else:
                key = tuple(r.items())[0]
                if key not in index:
                    index[key] = len(args)
                    args.append(dict(r))
                refs.append({"arg": index[key]})
        subs.append({"name": o["name"], "kind": o["kind"], "inputs": refs, "attrs": o.get("attrs", {}), **more(o)})
        deps |= set(o.get("deps", [])) - names
    return {"name": name, "kind": "fused", "lane": run[0]["lane"], "inputs": args, "deps": sorted(deps),
            "attrs": {"ops": subs}, "layer": run[0].get("layer", -1), "chunk": run[0].get("chunk", 0)}


def _renamed(plan: dict, out: list, renamed: dict, meta: dict) -> dict:
    """The plan of ops `out`, where readers of a fused run's last op read the fused op (renamed: last -> fused)."""
    for op in out:
        op["inputs"] = [{"op": renamed[r["op"]]} if r.get("op") in renamed else r for r in op.get("inputs", [])]
        if op.get("deps"):
            op["deps"] = [renamed.get(d, d) for d in op["deps"]]
    return {**plan, "ops": out, "outputs": [renamed.get(n, n) for n in plan["outputs"]], "meta": meta}
