"""Chunk graphs (mllm-NPU §3.2): a prompt cut into fixed chunks, each layer of each chunk cut into
subgraphs by where they run, with the dependencies of §3.4 (eq. 2, 3).

Per chunk i and layer l, four subgraphs (stage order within a layer):
    qkv     attn_norm + Q/K/V linears, int8                    -> npu   static (shared by all chunks)
    shadow  the shadow-outlier GEMMs of those linears, float    -> cpu   static
    attn    RoPE + attention over keys 0..end of chunk i, float -> cpu   dynamic (one per chunk index)
    ffn     output projection + ffn_norm + FFN linears, int8    -> npu   static
Intra-chunk: a subgraph waits for the previous stage of its chunk (eq. 3). Cross-chunk: attention of
chunk i waits for the Q/K/V (and shadow) subgraphs of chunks 0..i of its layer (eq. 2): it reads their K/V.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import EdgeprobeError
from ..models import ModelConfig

STAGES = ("qkv", "shadow", "attn", "ffn")
DEFAULT_LANES = {"qkv": "npu", "shadow": "cpu", "attn": "cpu", "ffn": "npu"}


class ScheduleError(EdgeprobeError, ValueError):
    """A chunking, schedule or device profile that cannot be used."""


@dataclass
class Subgraph:
    """One schedulable unit. flops / bytes are what the cost model prices; `static` says whether one
    pre-built graph serves every chunk (mllm-NPU's chunk-shared graph) or each chunk index needs its own."""

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
    act_bytes: int       # activation buffers it needs
    ops: list = field(default_factory=list)   # [(op kind, M, K, N)] of its GEMMs, for the cost model
    deps: list = field(default_factory=list)  # names


@dataclass
class ChunkGraph:
    config: ModelConfig
    prompt_len: int
    chunk_len: int
    subgraphs: list

    @property
    def n_chunks(self) -> int:
        return -(-self.prompt_len // self.chunk_len)

    def by_name(self) -> dict:
        return {g.name: g for g in self.subgraphs}

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
                shadow=True) -> ChunkGraph:
    """The subgraphs of every chunk and layer of a prompt (see module doc). lanes: stage -> lane.
    shadow: True (every layer has shadow-outlier GEMMs), False (none), or the layers that keep theirs
    (mllm-NPU prunes the outliers of the 85% least important layers)."""
    if not isinstance(chunk_len, int) or chunk_len < 1:
        raise ScheduleError(f"chunk length must be a positive number of tokens, got {chunk_len!r}")
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ScheduleError(f"prompt length must be a positive number of tokens, got {prompt_len!r}")
    if prompt_len > config.context_length:
        raise ScheduleError(f"prompt length {prompt_len} exceeds the model's context length {config.context_length}")
    if config.n_experts:
        raise ScheduleError("chunk graphs of MoE models are not built yet; schedule a dense model")
    lanes = {**DEFAULT_LANES, **(lanes or {})}
    c = config
    h, d = c.hidden, c.head_dim
    q_out, kv_out = c.n_heads * d, c.n_kv_heads * d
    n_chunks = -(-prompt_len // chunk_len)
    shadow_layers = set(range(c.n_layers)) if shadow is True else set() if shadow is False else set(shadow)
    subs: list[Subgraph] = []
    for i in range(n_chunks):
        T = min(chunk_len, prompt_len - i * chunk_len)
        Tp = chunk_len  # pre-built static graphs run the full chunk length (the last chunk is padded)
        end = i * chunk_len + T
        for l in range(c.n_layers):
            p = f"c{i}.l{l}"
            qkv_ops = [("int8_linear", Tp, h, q_out), ("int8_linear", Tp, h, kv_out), ("int8_linear", Tp, h, kv_out)]
            ffn_ops = [("int8_linear", Tp, q_out, h), ("int8_linear", Tp, h, c.ffn), ("int8_linear", Tp, h, c.ffn),
                       ("int8_linear", Tp, c.ffn, h)]
            attn_flops = 4 * c.n_heads * T * end * d  # QK^T and PV over `end` keys
            prev_ffn = [f"c{i}.l{l - 1}.ffn"] if l else []
            has_shadow = l in shadow_layers
            subs.append(Subgraph(f"{p}.qkv", i, l, "qkv", lanes["qkv"], True, T, 0, sum(2 * m * k * n for _, m, k, n in qkv_ops),
                                 h * (q_out + 2 * kv_out), 4 * Tp * (h + q_out + 2 * kv_out), qkv_ops, list(prev_ffn)))
            if has_shadow:
                subs.append(Subgraph(f"{p}.shadow", i, l, "shadow", lanes["shadow"], True, T, 0,
                                     2 * T * 8 * (q_out + 2 * kv_out),  # a few outlier channels per token (Fig. 10)
                                     4 * 8 * (q_out + 2 * kv_out), 4 * Tp * (q_out + 2 * kv_out),
                                     [("float_sparse", T, 8, q_out + 2 * kv_out)], list(prev_ffn)))
            attn_deps = [f"c{k}.l{l}.qkv" for k in range(i + 1)] + ([f"c{k}.l{l}.shadow" for k in range(i + 1)] if has_shadow else [])
            # beyond eq. 2: the previous chunk's attention subgraph is where its keys get RoPE and its K/V (int8 +
            # shadow parts) are summed into the cache this chunk reads
            attn_deps += [f"c{i - 1}.l{l}.attn"] if i else []
            subs.append(Subgraph(f"{p}.attn", i, l, "attn", lanes["attn"], False, T, end, attn_flops, 0,
                                 4 * (T * q_out + c.n_heads * T * end + T * q_out),
                                 [("attention", T, end, c.n_heads * d)], attn_deps))
            subs.append(Subgraph(f"{p}.ffn", i, l, "ffn", lanes["ffn"], True, T, 0, sum(2 * m * k * n for _, m, k, n in ffn_ops),
                                 q_out * h + 3 * h * c.ffn, 4 * Tp * (q_out + 2 * h + 3 * c.ffn), ffn_ops, [f"{p}.attn"]))
    return ChunkGraph(c, prompt_len, chunk_len, subs)
