"""Plans for the device agent from a QuantizedModel's manifest: the one template (graph.template), placed.

`prefill_plan` places the template's ops by kind (layer by layer, decode steps, batches, HeteroLLM splits, flash
streaming); `chunked_prefill_plan` places a chunked prefill's ops by the subgraphs of a Schedule (mllm-NPU
§3.2, §3.4). Neither writes the model: both take the ops `graph.model_ops` emits.
"""
from __future__ import annotations

import numpy as np

from edgeprobe_kernels.linear_records import SHADOW_SCHEMES, scheme_of, weight_blobs

from .graph import NPU_KINDS, Weights, model_ops, order_by_schedule, place_by_kind, place_by_stage
from .graph.place import fuse_layers, fuse_step, step_on_one_lane

# q4_0-tile decode steps on the npu lane alone, one fused op (bench/decode_overhead.py --split-lanes compares): a
# step split between lanes pays ~330 cross-lane hand-offs (~20 ms), one lane under 1 ms
ONE_LANE_DECODE = True


def one_lane_for(info: dict) -> bool:
    """Whether an agent (its hello `info`) runs a q4_0-tile decode step wholly on its npu lane: yes, unless that lane
    runs Hexagon code (the hvx backend computes linears only; the step's norms and attention would carry its "isa"
    label while numpy computed them)."""
    return ONE_LANE_DECODE and (info.get("backends") or {}).get("npu", {}).get("chosen", "numba") != "hvx"


__all__ = ["prefill_plan", "one_lane_for", "chunked_prefill_plan", "shadow_layers", "attach_expert_streaming",
           "NPU_KINDS"]


def prefill_plan(manifest: dict, n_tokens: int, last_only: bool = True, float_lane: str = "cpu",
                 split: dict | None = None, batch: int = 1, session: bool = False, ffn_flash: dict | None = None,
                 experts_flash: dict | None = None, one_lane: bool | None = None) -> dict:
    """Plan for `n_tokens` new positions of `batch` sequences (run input "tokens": int32[batch * n_tokens],
    sequence-major) -> logits float32[batch, vocab] of each sequence's last token (every row's with
    last_only=False). float_lane: where linears that are not NPU formats (float, q4_0 W4A16) run: "cpu", or
    "gpu" (OpenCL, HeteroLLM's GPU side). split: HeteroLLM §4.1 {matmul: schedule.hetero.Choice}.
    session: the run extends a decode session on the agent (a decode step is n_tokens=1). ffn_flash (LLM in a
    flash) and experts_flash (EdgeMoE §3.3): see graph.model_ops. one_lane (default ONE_LANE_DECODE): a decode step
    whose linears run on the npu lane (q4_0-tile) runs there whole, one fused op (graph.place.step_on_one_lane)."""
    ops = model_ops(Weights.of(manifest), n_tokens, batch=batch, session=session, last_only=last_only, split=split,
                    ffn_flash=ffn_flash, experts_flash=experts_flash)
    kind = "decode" if session and n_tokens == 1 else "prefill"
    decode = kind == "decode" and split is None
    plan = place_by_kind(ops, float_lane,
                         {"kind": kind, "tokens": n_tokens, "batch": batch, "scheme": manifest["scheme"]},
                         decode=decode)
    if not decode:
        return plan
    if ONE_LANE_DECODE if one_lane is None else one_lane:
        plan = step_on_one_lane(plan)  # q4_0-tile: the whole step on the npu lane, as the NPU TTS paper runs it
    return fuse_step(fuse_layers(plan, lanes=(plan["meta"].get("step_lane", "cpu"),)))  # a decode step: one op


def chunked_prefill_plan(manifest: dict, sched) -> dict:
    """The agent plan of a chunked prefill laid out by a Schedule: the template's ops of the schedule's chunking,
    each on its subgraph's lane, each lane in the order the schedule starts its subgraphs. Run input: "tokens"."""
    g = sched.graph
    ops = model_ops(Weights.of(manifest), g.prompt_len, chunk=g.chunk_len)
    lanes = {s.name: s.lane for s in g.subgraphs}
    placed = place_by_stage(ops)
    for op in placed:  # the graph's lanes (it may have moved a stage to another lane)
        op["lane"] = lanes.get(op["group"], op["lane"])
    return order_by_schedule(placed, sched.slots, {"kind": "chunked-prefill", "tokens": g.prompt_len,
                                                   "chunk": g.chunk_len, "scheduler": sched.scheduler,
                                                   "cost_model": sched.cost_model.name,
                                                   "profile": sched.cost_model.name})  # the field's first name


def shadow_layers(manifest: dict) -> list[int]:
    """Layers whose Q/K/V linears keep shadow outliers (w8a8-shadow not pruned, or w8a8c-shadow)."""
    c, L = manifest["config"], manifest["linears"]
    return [l for l in range(c["n_layers"])
            if any(scheme_of(L[f"blk.{l}.{p}"]) in SHADOW_SCHEMES and L[f"blk.{l}.{p}"].get("shadow")
                   for p in ("attn_q", "attn_k", "attn_v"))]


def attach_expert_streaming(qm, predictor=None) -> None:
    """Mark `qm`'s expert weights as streamed from flash (not counted resident by the agent's memory budget)
    and add the preload predictor's tables (profile.experts.PreloadPredictor) as blobs."""
    c = qm.manifest["config"]
    if not c.get("n_experts"):
        raise ValueError("expert streaming is for MoE models")
    shas = set()
    for i in range(c["n_layers"]):
        for r in Weights.of(qm.manifest).experts(i):
            for rec in r.values():
                shas |= weight_blobs(rec)
    qm.manifest["streamed_blobs"] = sorted(shas)
    if predictor is not None:
        qm.manifest["expert_predictor"] = {
            k: (qm.store.put(np.asarray(v), f"expert_predictor.{k}") if np.ndim(v) else int(v))
            for k, v in predictor.to_arrays().items()}
        qm.manifest["blobs"] = qm.store.meta


