"""The model as ops, written once: a config (and, when quantized, its manifest) -> the ops of one run.

`model_ops` emits, in program order (chunk-major: chunk, layer, stage), every op a run of the model
executes — for every model the forward pass runs (dense, MoE with or without a shared expert), every
phase (prefill, chunked prefill, decode and batched decode in a session) and every placement option that
changes the computation (HeteroLLM splits of int8 GEMMs, FFN neurons or experts streamed from flash).
Each op is a dict the agent executes (`edgeprobe_agent.executor`) with tags the host reads:

    name     "blk.3.attn_q" (one chunk) or "c1.l3.attn_q" (chunk 1 of a chunked prefill)
    kind     an op kind of edgeprobe_kernels.names.OP_KINDS
    inputs   [{"op": name} | {"blob": sha} | {"tensor": name} (symbolic, no manifest) | {"input": "tokens"}]
    attrs    what the kernel needs (rec: the linear's quantized record, eps, heads, ...)
    layer, chunk, stage   stage in qkv | shadow | attn | ffn (mllm-NPU §3.2's subgraphs; embed is qkv of layer 0,
                          the output norm and LM head are ffn of the last layer)
    group    "c{chunk}.l{layer}.{stage}": the subgraph the op belongs to
    shape    [rows, features] of its output, float32
    cost     [cost kind, FLOPs, weight bytes read]: what a cost model prices (schedule.cost)
    lane     only where the computation itself fixes it (a HeteroLLM split's pieces); placement does the rest

The agent's plan (graph.place), the chunk graph the schedulers order (schedule.graph: ops grouped by
`group`, dependencies from the ops' data edges), the cost model and the host's float pass (`forward.py`, run
in-process by graph.local with hooks at the ops named in names.HOOK_OPS) all derive from these ops.
"""
from __future__ import annotations

import math

from edgeprobe_kernels import names as N
from edgeprobe_kernels.linear_records import SHADOW_SCHEMES, W8A8_SCHEMES, scheme_of, weight_blobs

from ..errors import EdgeprobeError

GRAPH_VERSION = 2  # bump when ops, names or costs change: measured cost models are fitted on them
STAGES = ("qkv", "shadow", "attn", "ffn")
INT8_SCHEMES = W8A8_SCHEMES | {"smoothquant", "llm-int8"}  # records whose GEMM is int8 x int8
INT8_KINDS = INT8_SCHEMES  # its name before records said `scheme`
NPU_KINDS = W8A8_SCHEMES | {"smoothquant", "q4_0-tile"}          # what a mobile NPU runs (NPU TTS paper §3)
SHADOW_CHANNELS = 8  # outlier channels per token a shadow GEMM is priced at (mllm-NPU Fig. 10: ~1% of channels)


class GraphError(EdgeprobeError, ValueError):
    """A model, phase or placement the template cannot build ops for."""


class Weights:
    """What the template's weight references point at: a QuantizedModel manifest (blob shas, records) or, for
    a graph built from a config alone (scheduling before quantizing), names and stand-in int8 records.

    shadow (config only): layers whose linears keep float shadow outliers (w8a8-shadow); True = all.
    floats (config only): every linear a float record (the host's float pass, graph.local.run_float)."""

    def __init__(self, config, manifest: dict | None = None, shadow=True, floats: bool = False, q8_head: bool = False,
                 scheme: str | None = None):
        import dataclasses

        self.config = dict(config) if isinstance(config, dict) else dataclasses.asdict(config)
        self.manifest = manifest
        self.floats = floats
        self.scheme = scheme  # config only: the planned scheme's stand-in records (None: w8a8 / w8a8-shadow)
        self.q8_head = q8_head  # config only: price the LM head as the Q8_0 a quantized model carries
        L = self.config["n_layers"]
        self.shadow = set(range(L)) if shadow is True else set() if shadow in (False, None) else set(shadow)

    @classmethod
    def of(cls, manifest: dict) -> "Weights":
        """A QuantizedModel's manifest, or a plan of one made from a config alone (models.config.plan_manifest:
        stand-in records of its scheme, no blobs)."""
        plan = manifest.get("planned")
        if plan is not None:
            return cls(manifest["config"], None, shadow=plan["shadow"], floats=plan["floats"],
                       q8_head=plan.get("q8_head", False), scheme=plan.get("scheme"))
        return cls(manifest["config"], manifest)

    def tensor(self, name: str) -> dict:
        if self.manifest is None:
            return {"tensor": name}
        T = self.manifest["tensors"]
        if name == N.OUTPUT and name not in T:
            name = N.TOKEN_EMBD  # tied output
        if name not in T:
            raise GraphError(f"the manifest has no tensor {name!r}; quantize the model again")
        return {"blob": T[name]}

    def head(self) -> tuple[list, int]:
        """The LM head's weight inputs and their bytes: a quantized model's Q8_0 head (codes, scales; see
        quant.qmodel), else the float output matrix."""
        c = self.config
        n = c["vocab_size"] * c["hidden"]
        hd = (self.manifest or {}).get("head")
        if hd:
            return [{"blob": hd["codes"]}, {"blob": hd["scales"]}], n + n // 32 * 4
        return [self.tensor(N.OUTPUT)], n + n // 32 * 4 if self.q8_head else n * 4

    def rec(self, linear: str) -> dict:
        if self.manifest is not None:
            L = self.manifest["linears"]
            if linear not in L:
                raise GraphError(f"the manifest has no linear {linear!r}; quantize the model again")
            return L[linear]
        layer = N.layer_of(linear)
        if self.floats:
            return {"kind": "float", "shape": list(self.shape(linear))}
        if linear.endswith(N.ROUTERS):
            kind = "float"
        elif self.scheme in (None, "w8a8", "w8a8-shadow"):
            kind = "w8a8-shadow" if layer in self.shadow else "w8a8"
        else:
            kind = self.scheme
        rec = {"kind": kind, "shape": list(self.shape(linear)), "shadow": layer in self.shadow}
        if kind == "moe-mixed":
            rec["bits"] = 4 if "_exps." in linear else 8  # EdgeMoE's default expert width; the rest INT8
        return rec

    def shape(self, linear: str) -> tuple:
        """[out, in] of a linear from the config (what a stand-in record and the costs need)."""
        c = self.config
        h, d = c["hidden"], c["head_dim"]
        q, kv = c["n_heads"] * d, c["n_kv_heads"] * d
        # an expert "blk.0.ffn_gate_exps.3" is shaped by its stacked tensor ffn_gate_exps (expert_ffn wide)
        p = N.matmul_of(linear.rsplit(".", 1)[0]) if "_exps." in linear else N.matmul_of(linear)
        f, fe, fs = c["ffn"], c.get("expert_ffn") or c["ffn"], c.get("shared_expert_ffn", 0)
        return {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
                "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f), "ffn_gate_exps": (fe, h),
                "ffn_up_exps": (fe, h), "ffn_down_exps": (h, fe), "ffn_gate_shexp": (fs, h), "ffn_up_shexp": (fs, h),
                "ffn_down_shexp": (h, fs), "ffn_gate_inp": (c.get("n_experts", 0), h), "ffn_gate_inp_shexp": (1, h)}[p]

    def weight_bytes(self, rec: dict, shape) -> int:
        """Bytes of a record's weights [out, in]: the blobs' sizes with a manifest, else 1 byte per int8 weight."""
        if self.manifest is not None and "blobs" in self.manifest:
            blobs = self.manifest["blobs"]
            return int(sum(blobs[s]["nbytes"] for s in weight_blobs(rec) if s in blobs))
        return planned_bytes(scheme_of(rec), shape, rec.get("bits", 8))

    def experts(self, layer: int) -> list:
        E = self.config["n_experts"]
        return [{p: self.rec(f"blk.{layer}.ffn_{p}_exps.{e}") for p in ("gate", "up", "down")} for e in range(E)]

    def moe_attrs(self, layer: int, flash: dict | None) -> dict:
        """attrs of the moe_ffn op (EdgeMoE §3.3: flash {capacity, policy, preload_n} streams experts)."""
        c = self.config
        a = {"moe_layer": layer, "n_layers": c["n_layers"], "k": c["n_experts_used"],
             "norm_topk": c.get("norm_topk", True), "experts": self.experts(layer), "flash": flash}
        if flash is not None:
            pred = (self.manifest or {}).get("expert_predictor")
            if (flash.get("preload_n") or flash.get("policy") == "edgemoe") and not pred:
                raise GraphError("preloading and the edgemoe policy need the co-activation tables: "
                                 "attach_expert_streaming(qm, predictor) first")
            a["predictor"] = pred
            a["next_experts"] = self.experts((layer + 1) % c["n_layers"])
        return a

    def neurons(self, layer: int) -> dict:
        nr = (self.manifest or {}).get("neurons", {}).get(str(layer))
        if nr is None:
            raise GraphError("ffn_flash needs neuron bundles (edgeprobe.neurons.add_bundles) and a decode session")
        return nr


def planned_bytes(scheme: str, shape, bits: int = 8) -> int:
    """Bytes a linear's weights [out, in] take in `scheme`'s stored format, from the shape alone (quant.schemes
    writes them so): float32; int8 codes (+ float32 scales per output channel where the scheme has them); ggml Q4_0
    blocks of 32 along K (18 bytes: FP16 scale and 16 bytes of codes), q4_0-tile over the 32-padded tile layout;
    moe-mixed `bits`-bit codes with a float32 scale per output channel."""
    n, k = (int(v) for v in shape)
    pad = lambda v: -(-v // 32) * 32
    if scheme == "float":
        return 4 * n * k
    if scheme in ("w8a8c-shadow", "llm-int8"):
        return n * k + 4 * n
    if scheme == "smoothquant":
        return n * k + 4 * k
    if scheme == "q4_0":
        return n * (pad(k) // 32) * 18
    if scheme == "q4_0-tile":
        return pad(n) * (pad(k) // 32) * 18
    if scheme == "moe-mixed":
        return (n * k * bits + 7) // 8 + 4 * n
    return n * k


def model_ops(w: Weights, tokens: int, *, batch: int = 1, chunk: int | None = None, session: bool = False,
              last_only: bool = True, split: dict | None = None, ffn_flash: dict | None = None,
              experts_flash: dict | None = None) -> list[dict]:
    """The ops of one run over `tokens` new positions of each of `batch` sequences (run input "tokens":
    int32[batch * tokens], sequence-major) -> the last op, "lm_head": float32[batch, vocab] (every row's
    logits with last_only=False).

    chunk: mllm-NPU §3.2's chunked prefill: the prompt cut into chunks of `chunk` tokens; chunk i attends to
        the keys of chunks 0..i (eq. 2). None: one chunk (layer by layer).
    session: the run extends a decode session's KV cache on the agent: positions start at its length (decode
        steps are tokens=1). split: HeteroLLM §4.1 {matmul ("attn_q", ..., "ffn_down"): schedule.hetero.Choice}
        for int8 GEMMs across the gpu and npu lanes. ffn_flash: LLM in a flash {"mode", "window"} (each dense FFN
        one op reading its neurons from flash). experts_flash: EdgeMoE {"capacity", "policy", "preload_n"}.
    """
    c = w.config
    cfg = _config(c)
    if not isinstance(tokens, int) or tokens < 1:
        raise GraphError(f"a run needs at least one token, got {tokens!r}")
    if chunk is not None and (session or batch != 1 or not last_only):
        raise GraphError("a chunked prefill is one sequence's prefill (no session, batch 1, last logits only)")
    if (experts_flash is not None or ffn_flash) and not session:
        raise GraphError("experts and FFN neurons from flash keep their buffers in a decode session "
                         "(Device.generate / Device.session)")
    if ffn_flash and c.get("n_experts"):
        raise GraphError("ffn_flash streams the neurons of dense FFNs; MoE models stream experts (experts_flash)")
    chunk_len = chunk or tokens
    n_chunks = math.ceil(tokens / chunk_len)
    L, h, d = c["n_layers"], c["hidden"], c["head_dim"]
    H, KV, eps, theta = c["n_heads"], c["n_kv_heads"], c["rms_eps"], c["rope_theta"]
    ops: list[dict] = []
    # a decode step runs on one processor (mllm-NPU decodes with its CPU backend): no hand-off between an int8
    # GEMM and its shadow, so each linear is one op computing both (fewer ops: decode is per-op-overhead bound)
    one_op_linears = session and tokens == 1 and split is None

    def add(name, kind, inputs, layer, ci, stage, shape, cost=("elementwise", None, 0), group_layer=None, **attrs):
        flops = cost[1] if cost[1] is not None else int(shape[0] * shape[1])
        op = {"name": name, "kind": kind, "inputs": inputs, "deps": [], "attrs": attrs, "layer": layer, "chunk": ci,
              "stage": stage, "group": f"c{ci}.l{layer if group_layer is None else group_layer}.{stage}",
              "shape": [int(shape[0]), int(shape[1])], "cost": [cost[0], int(flops), int(cost[2])]}
        lane = attrs.pop("_lane", None)
        if lane:
            op["lane"] = lane
        ops.append(op)
        return {"op": name}

    def linear(pfx, lname, x, l, ci, stage, R, shadow_in=None):
        """One linear of layer l as its record computes it: an int8 GEMM, with its float shadow (mllm-NPU
        eq. 1) as separate ops so it can run on another processor, possibly split (HeteroLLM)."""
        name = f"blk.{l}.{lname}"
        rec = w.rec(name)
        n_out, k_in = rec.get("shape") or w.shape(name)
        op = f"{pfx}.{lname}"
        wb = w.weight_bytes(rec, (n_out, k_in))
        shadowed = scheme_of(rec) in SHADOW_SCHEMES and bool(rec.get("shadow")) and not one_op_linears
        choice = (split or {}).get(lname)
        if choice is not None and scheme_of(rec) not in W8A8_SCHEMES:
            raise GraphError(f"a HeteroLLM split needs int8 linears ({', '.join(sorted(W8A8_SCHEMES))}); "
                             f"{name} is {rec['kind']!r}")
        gemm = ("int8_linear" if scheme_of(rec) in INT8_SCHEMES else "linear", 2 * R * k_in * n_out, wb)
        part = "int8" if shadowed else "all"
        if choice is not None:
            y = _split(add, op, x, l, ci, stage, R, rec, choice, gemm)
        else:
            y = add(f"{op}.int8" if shadowed else op, "linear", [x], l, ci, stage, (R, n_out), gemm, rec=rec, part=part)
        if not shadowed:
            return y
        sh_stage = "shadow" if lname in N.ATTN_IN else stage
        b = add(f"{op}.shadow", "linear", [shadow_in or x], l, ci, sh_stage, (R, n_out),
                ("float_sparse", 2 * R * SHADOW_CHANNELS * n_out, 0), rec=rec, part="shadow")
        return add(f"{op}.sum", "add", [y, b], l, ci, "attn" if lname in N.ATTN_IN else stage, (R, n_out))

    # Gemma's score scale (1/sqrt(query_pre_attn_scalar)) and Gemma 2's soft-caps, only where a model has them
    scores = {k: float(c.get(f, 0.0)) for k, f in (("scale", "attn_scale"), ("softcap", "attn_softcap")) if c.get(f)}
    kv: dict = {}  # (chunk, layer) -> (k after RoPE, v): what later chunks' attention reads
    for ci in range(n_chunks):
        start = ci * chunk_len
        T = min(chunk_len, tokens - start)
        R = batch * T
        pfx_of = (lambda l: f"c{ci}.l{l}") if chunk is not None else (lambda l: f"blk.{l}")
        span = {"start": start, "length": T} if chunk is not None else {}
        if cfg.embed_scale != 1.0:
            span["scale"] = cfg.embed_scale  # Gemma: embeddings times sqrt(hidden)
        emb = lambda name, stage: add(name, "embed", [{"input": "tokens"}, w.tensor(N.TOKEN_EMBD)], 0, ci, stage,
                                      (R, h), ("elementwise", R * h, 0), **span)
        x = emb(f"c{ci}.embed" if chunk is not None else "embed", "qkv")
        for l in range(L):
            p = pfx_of(l)
            norm_w = w.tensor(N.weight(N.blk(l, "attn_norm")))
            n = add(f"{p}.attn_norm", "rms_norm", [x, norm_w], l, ci, "qkv", (R, h), eps=eps)
            shadowed = [q for q in N.ATTN_IN
                        if scheme_of(w.rec(N.blk(l, q))) in SHADOW_SCHEMES and w.rec(N.blk(l, q)).get("shadow")]
            sn = None
            if shadowed:  # the shadow subgraph normalizes on its own: its only dependency is the previous layer
                sx = emb(f"{p}.shadow_embed", "shadow") if l == 0 else x
                sn = add(f"{p}.shadow_norm", "rms_norm", [sx, norm_w], l, ci, "shadow", (R, h), eps=eps)
            q, k, v = (linear(p, lname, n, l, ci, "qkv", R, sn) for lname in N.ATTN_IN)
            sess = {"session": True} if session else {}
            pos = {"start": start} if chunk is not None else {}
            if cfg.attn_bias:  # Qwen2: biases on Q, K and V (float, on the attention's lane)
                q, k, v = (add(f"{p}.{n}.bias", "add", [y, w.tensor(f"blk.{l}.{n}.bias")], l, ci, "attn", (R, width))
                           for y, n, width in ((q, "attn_q", H * d), (k, "attn_k", KV * d), (v, "attn_v", KV * d)))
            if cfg.qk_norm:  # Gemma 3, Qwen3: RMSNorm of each query / key head before RoPE
                q = add(f"{p}.q_norm", "rms_norm", [q, w.tensor(N.weight(N.blk(l, "attn_q_norm")))], l, ci, "attn",
                        (R, H * d), eps=eps, head_dim=d)
                k = add(f"{p}.k_norm", "rms_norm", [k, w.tensor(N.weight(N.blk(l, "attn_k_norm")))], l, ci, "attn",
                        (R, KV * d), eps=eps, head_dim=d)
            theta = cfg.theta(l)
            freqs = {"freq_factors": list(cfg.rope_freq_factors)} if cfg.rope_freq_factors else {}
            q = add(f"{p}.rope_q", "rope", [q], l, ci, "attn", (R, H * d), heads=H, head_dim=d, theta=theta,
                    batch=batch, **pos, **sess, **freqs)
            k = add(f"{p}.rope_k", "rope", [k], l, ci, "attn", (R, KV * d), heads=KV, head_dim=d, theta=theta,
                    batch=batch, **pos, **sess, **freqs)
            kv[(ci, l)] = (k, v)
            keys = start + T  # keys attended by the chunk's last query (a session's cache adds its length)
            win = cfg.window(l)
            if win:
                keys = min(keys, win)
            ins = [q] + [kv[(j, l)][0] for j in range(ci + 1)] + [kv[(j, l)][1] for j in range(ci + 1)]
            a = add(f"{p}.attention", "attention", ins, l, ci, "attn", (R, H * d),
                    ("attention", 4 * batch * H * T * keys * d, 0), n_heads=H, n_kv_heads=KV, head_dim=d, batch=batch,
                    **({"parts": ci + 1} if chunk is not None else {}), **pos, **sess,
                    **({"kv_layer": l} if session else {}), **({"window": win} if win else {}), **scores)
            o = linear(p, "attn_output", a, l, ci, "ffn", R)
            if cfg.post_norms:  # Gemma: the attention's output normalized before the residual
                pw = w.tensor(N.weight(N.blk(l, "post_attention_norm")))
                o = add(f"{p}.post_attention_norm", "rms_norm", [o, pw], l, ci, "ffn", (R, h), eps=eps)
            x = add(f"{p}.attn_residual", "add", [x, o], l, ci, "ffn", (R, h))
            n2 = add(f"{p}.ffn_norm", "rms_norm", [x, w.tensor(N.weight(N.blk(l, "ffn_norm")))], l, ci, "ffn", (R, h),
                     eps=eps)
            f = _ffn(add, linear, w, p, n2, l, ci, R, ffn_flash, experts_flash)
            if cfg.post_norms:
                pw = w.tensor(N.weight(N.blk(l, "post_ffw_norm")))
                f = add(f"{p}.post_ffw_norm", "rms_norm", [f, pw], l, ci, "ffn", (R, h), eps=eps)
            x = add(f"{p}.ffn_residual", "add", [x, f], l, ci, "ffn", (R, h))
    rows = batch if last_only else batch * tokens
    n = add("output_norm", "rms_norm", [x, w.tensor(N.OUTPUT_NORM)], -1, n_chunks - 1, "ffn", (R, h),
            group_layer=L - 1, eps=eps)
    vocab = c["vocab_size"]
    head, head_bytes = w.head()
    add("lm_head", "lm_head", [n, *head], -1, n_chunks - 1, "ffn", (rows, vocab),
        ("linear", 2 * rows * h * vocab, head_bytes), group_layer=L - 1, last_only=last_only, batch=batch,
        **({"softcap": float(c["final_softcap"])} if c.get("final_softcap") else {}))
    return ops


def _ffn(add, linear, w, p, x, l, ci, R, ffn_flash, experts_flash):
    """The FFN of layer l: SwiGLU, or mixture of experts (+ shared expert), or neurons from flash."""
    c = w.config
    h = c["hidden"]
    if c.get("n_experts"):
        router = w.rec(N.blk(l, "ffn_gate_inp"))
        if scheme_of(router) != "float":
            raise GraphError(f"the agent runs float routers; blk.{l}.ffn_gate_inp is {router.get('kind')!r}")
        attrs = w.moe_attrs(l, experts_flash)
        fe, k, E = c.get("expert_ffn") or c["ffn"], c["n_experts_used"], c["n_experts"]
        wb = sum(w.weight_bytes(r, r.get("shape") or (fe, h)) for ex in attrs["experts"] for r in ex.values())
        rw = {"blob": router["w"]} if "w" in router else w.tensor(N.weight(N.blk(l, "ffn_gate_inp")))
        y = add(f"{p}.moe_ffn", "moe_ffn", [x, rw], l, ci, "ffn", (R, h),
                ("linear", 2 * R * h * E + 2 * R * k * 3 * h * fe, wb), **attrs)
        if not c.get("shared_expert_ffn"):
            return y
        s = _swiglu(add, linear, p, x, l, ci, R, "_shexp", c["shared_expert_ffn"])
        if c.get("shared_expert_gate"):  # Qwen-MoE: sigmoid(ffn_gate_inp_shexp · x) scales the shared expert
            g = linear(p, "ffn_gate_inp_shexp", x, l, ci, "ffn", R)
            s = add(f"{p}.shexp_gate", "sigmoid_mul", [s, g], l, ci, "ffn", (R, h))
        return add(f"{p}.ffn_moe_sum", "add", [y, s], l, ci, "ffn", (R, h))
    if ffn_flash:
        nr = w.neurons(l)
        f = c["ffn"]
        pred = [{"blob": nr[k]} for k in ("A", "B", "b")]
        return add(f"{p}.ffn_flash", "ffn_flash", [x] + pred, l, ci, "ffn", (R, h),
                   ("linear", 2 * R * h * 3 * f, 0), bundle=nr["bundle"], ffn_layer=l, cutoff=nr["cutoff"],
                   window=int(ffn_flash.get("window", 5)), mode=ffn_flash.get("mode", "sparse"))
    return _swiglu(add, linear, p, x, l, ci, R, "", c["ffn"], "geglu" if c.get("act_fn") == "gelu_tanh" else "swiglu")


def _swiglu(add, linear, p, x, l, ci, R, suffix, width, act="swiglu"):
    g = linear(p, f"ffn_gate{suffix}", x, l, ci, "ffn", R)
    u = linear(p, f"ffn_up{suffix}", x, l, ci, "ffn", R)
    a = add(f"{p}.{act}{suffix}", act, [g, u], l, ci, "ffn", (R, width))
    return linear(p, f"ffn_down{suffix}", a, l, ci, "ffn", R)


def _config(c: dict):
    """A ModelConfig from a manifest's config dict (older manifests lack the newer fields: their defaults)."""
    import dataclasses

    from ..models import ModelConfig

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in c.items() if k in known})


def _npu_pieces(start: int, end: int, lengths) -> list:
    """Rows [start, end) cut into consecutive pieces, one per pre-built NPU length: (a, b, L), b - a <= L."""
    out, a = [], start
    for n in lengths:
        if a >= end:
            break
        out.append((a, min(a + n, end), n))
        a += n
    if a < end:
        raise GraphError(f"pre-built lengths {list(lengths)} do not cover rows {start}..{end}")
    return out


def _split(add, op, x, l, ci, stage, m, rec, ch, gemm):
    """One int8 GEMM as HeteroLLM's solver chose (§4.1; strategy names of schedule.hetero): the NPU runs only
    pre-built lengths (pad_to: its rows padded and computed), the GPU any shape."""
    n_out, k_in = rec["shape"]
    s = ch.strategy
    cost = lambda rows, cols: ("int8_linear", 2 * rows * k_in * cols, gemm[2] * cols // max(n_out, 1))

    def npu(a_rows, b_rows, lengths, cols=None, tag="npu"):
        pieces = _npu_pieces(a_rows, b_rows, lengths)
        width = (cols[1] - cols[0]) if cols else n_out
        outs = [add(f"{op}.{tag}{j}", "linear", [x], l, ci, stage, (b - a, width), cost(L, width), _lane="npu", rec=rec,
                    part="int8", rows=[a, b], pad_to=L, **({"cols": list(cols)} if cols else {}))
                for j, (a, b, L) in enumerate(pieces)]
        if len(outs) == 1:
            return outs[0]
        return add(f"{op}.{tag}cat", "concat", outs, l, ci, stage, (b_rows - a_rows, width), _lane="npu", axis=0)

    if s == "gpu":
        return add(f"{op}.gpu", "linear", [x], l, ci, stage, (m, n_out), gemm, _lane="gpu", rec=rec, part="int8")
    if s in ("npu-pad", "pipe"):
        return npu(0, m, list(ch.npu_parts))
    if s == "seq-cut":
        a = npu(0, ch.npu_rows, list(ch.npu_parts))
        if ch.npu_rows >= m:
            return a
        b = add(f"{op}.gpu", "linear", [x], l, ci, stage, (m - ch.npu_rows, n_out), cost(m - ch.npu_rows, n_out),
                _lane="gpu", rec=rec, part="int8", rows=[ch.npu_rows, m])
        return add(f"{op}.cat", "concat", [a, b], l, ci, stage, (m, n_out), _lane="cpu", axis=0)
    if s == "row-cut":
        a = npu(0, m, list(ch.npu_parts), cols=(0, ch.npu_cols))
        b = add(f"{op}.gpu", "linear", [x], l, ci, stage, (m, n_out - ch.npu_cols), cost(m, n_out - ch.npu_cols),
                _lane="gpu", rec=rec, part="int8", cols=[ch.npu_cols, n_out])
        return add(f"{op}.cat", "concat", [a, b], l, ci, stage, (m, n_out), _lane="cpu", axis=1)
    raise GraphError(f"unknown partition strategy {s!r}")
