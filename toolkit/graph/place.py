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

from .template import NPU_KINDS, GraphError

DEFAULT_STAGE_LANES = {"qkv": "npu", "shadow": "cpu", "attn": "cpu", "ffn": "npu"}


def lane_by_kind(op: dict, float_lane: str = "cpu") -> str:
    if op.get("lane"):
        return op["lane"]
    if op["kind"] != "linear":
        return "cpu"
    part = op["attrs"].get("part", "all")
    if part == "shadow":
        return "cpu"
    return "npu" if op["attrs"]["rec"]["kind"] in NPU_KINDS else float_lane


def place_by_kind(ops: list, float_lane: str = "cpu", meta: dict | None = None) -> dict:
    """A layer-by-layer plan: lanes by op kind, each lane in program order. Ungrouped (group = op)."""
    out = []
    for op in ops:
        o = {k: v for k, v in op.items() if k != "group"}
        o["lane"] = lane_by_kind(op, float_lane)
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
