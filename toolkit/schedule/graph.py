"""Chunk graphs (mllm-NPU §3.2): a prompt cut into fixed chunks, each layer of each chunk cut into
subgraphs by where they run — a view that groups the ops of the one template (graph.template).

Per chunk i and layer l, up to four subgraphs (stage order within a layer):
    qkv     attn_norm + Q/K/V linears, int8                    -> npu   static (shared by all chunks)
    shadow  the shadow-outlier GEMMs of those linears, float    -> cpu   static
    attn    RoPE + attention over keys 0..end of chunk i, float -> cpu   dynamic (one per chunk index)
    ffn     output projection + ffn_norm + FFN (or experts)     -> npu   static
Dependencies are not kept by hand: subgraph A depends on B when one of A's ops reads an output of one of
B's (eq. 2 and 3 follow: attention of chunk i reads the keys of chunks 0..i).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import EdgeprobeError
from ..graph import DEFAULT_STAGE_LANES, STAGES, GraphError, Weights, model_ops, place_by_stage
from ..models import ModelConfig

DEFAULT_LANES = DEFAULT_STAGE_LANES


class ScheduleError(EdgeprobeError, ValueError):
    """A chunking, schedule or cost model that cannot be used."""


@dataclass
class Subgraph:
    """One schedulable unit: a group of template ops on one lane. flops / bytes are what the cost model prices;
    `static` says whether one pre-built graph serves every chunk (mllm-NPU's chunk-shared graph) or each chunk
    index needs its own."""

    name: str
    chunk: int
    layer: int
    stage: str
    lane: str
    static: bool
    tokens: int          # rows in this chunk
    kv_len: int          # keys attended (attention), else 0
    flops: int
    weight_bytes: int    # weights the subgraph reads (int8 linears: 1 byte per weight)
    act_bytes: int       # activation buffers it writes (float32)
    ops: list = field(default_factory=list)   # names of its template ops, in program order
    deps: list = field(default_factory=list)  # subgraph names, from the ops' data edges
    costs: list = field(default_factory=list)  # [(cost kind, FLOPs)] of its ops, for the cost model


@dataclass
class ChunkGraph:
    config: ModelConfig
    prompt_len: int
    chunk_len: int
    subgraphs: list
    ops: list = field(default_factory=list)  # the placed template ops (op dicts), program order

    @property
    def n_chunks(self) -> int:
        return -(-self.prompt_len // self.chunk_len)

    def by_name(self) -> dict:
        return {g.name: g for g in self.subgraphs}

    def ops_of(self) -> dict:
        """subgraph name -> its op dicts, in program order."""
        out: dict = {}
        for op in self.ops:
            out.setdefault(op["group"], []).append(op)
        return out

    def memory(self, dtype_bytes: int = 4) -> dict:
        """Bytes of pre-built graphs: one graph per chunk (each with its own weights and buffers) against
        chunk-shared graphs (static subgraphs built once, dynamic ones per chunk index) — §3.2, Fig. 7."""
        static = [g for g in self.subgraphs if g.chunk == 0 and g.static]
        dynamic_all = [g for g in self.subgraphs if not g.static]
        per_chunk_graph = sum(g.weight_bytes + g.act_bytes for g in self.subgraphs if g.chunk == 0)
        chunk_graphs = 0
        for i in range(self.n_chunks):  # every chunk's full graph: weights copied, buffers sized for it
            chunk_graphs += sum(g.weight_bytes + g.act_bytes for g in self.subgraphs if g.chunk == i)
        shared = sum(g.weight_bytes + g.act_bytes for g in static) + sum(g.act_bytes for g in dynamic_all)
        n_sub = len([g for g in self.subgraphs if g.chunk == 0])
        return {"chunk_graphs_bytes": chunk_graphs, "chunk_shared_bytes": shared,
                "saving": 1 - shared / max(chunk_graphs, 1), "per_chunk_graph_bytes": per_chunk_graph,
                "subgraphs_per_chunk": n_sub, "shared_subgraphs": len(static),
                "subgraphs_built_shared": len(static) + len({(g.layer, g.chunk) for g in dynamic_all}),
                "subgraphs_built_per_chunk": n_sub * self.n_chunks}


def chunk_graph(config: ModelConfig, prompt_len: int, chunk_len: int = 256, lanes: dict | None = None,
                shadow=True, manifest: dict | None = None) -> ChunkGraph:
    """The subgraphs of every chunk and layer of a prompt (see module doc). lanes: stage -> lane.
    shadow: True (every layer keeps shadow-outlier GEMMs), False (none), or the layers that keep theirs
    (mllm-NPU prunes the outliers of the 85% least important layers). manifest: a QuantizedModel's, whose
    records (kinds, shadows, blob sizes) then decide the ops instead of `shadow`."""
    if not isinstance(chunk_len, int) or chunk_len < 1:
        raise ScheduleError(f"chunk length must be a positive number of tokens, got {chunk_len!r}")
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ScheduleError(f"prompt length must be a positive number of tokens, got {prompt_len!r}")
    if prompt_len > config.context_length:
        raise ScheduleError(f"prompt length {prompt_len} exceeds the model's context length {config.context_length}")
    bad = set(lanes or {}) - set(STAGES)
    if bad:
        raise ScheduleError(f"lanes are given per stage ({', '.join(STAGES)}), not {sorted(bad)}")
    w = Weights.of(manifest) if manifest is not None else Weights(config, shadow=shadow)
    try:
        ops = place_by_stage(model_ops(w, prompt_len, chunk=chunk_len), lanes)
    except GraphError as e:
        raise ScheduleError(str(e)) from None
    return ChunkGraph(config, prompt_len, chunk_len, group_ops(ops), ops)


def group_ops(ops: list) -> list:
    """Template ops (placed, with groups) -> Subgraphs in program order, dependencies from data edges."""
    group_of = {op["name"]: op["group"] for op in ops}
    subs: dict = {}
    for op in ops:
        g = op["group"]
        s = subs.get(g)
        if s is None:
            s = subs[g] = Subgraph(g, op["chunk"], int(g.split(".")[1][1:]), op["stage"], op["lane"],
                                   op["stage"] != "attn", op["shape"][0], 0, 0, 0, 0)
        if op["lane"] != s.lane:
            raise ScheduleError(f"subgraph {g} spans lanes {s.lane} and {op['lane']}; a subgraph runs on one lane")
        kind, fl, wb = op["cost"]
        s.ops.append(op["name"])
        s.costs.append((kind, fl))
        s.flops += fl
        if op["layer"] >= 0:  # the output norm and LM head are outside the chunk graphs' memory (Fig. 7)
            s.weight_bytes += wb
            s.act_bytes += 4 * op["shape"][0] * op["shape"][1]
        if op["kind"] == "attention":
            s.kv_len = int(op["attrs"].get("start", 0)) + op["shape"][0]
        for ref in op["inputs"]:
            d = group_of.get(ref.get("op")) if isinstance(ref, dict) else None
            if d is not None and d != g and d not in s.deps:
                s.deps.append(d)
    return list(subs.values())
