"""Plans for the device agent, built from a QuantizedModel's manifest (pure data; see edgeprobe_agent.executor).

`prefill_plan` is the layer-by-layer prefill of one sequence: int8 linears on the `npu` lane (NPU
semantics, emulated on this CPU), their shadow-outlier GEMMs and every float op on `cpu`, so the two
lanes overlap wherever the dependencies allow (mllm-NPU §3.3's CPU/NPU split). The scheduling issue
replaces the order; the op vocabulary stays.
"""
from __future__ import annotations

import numpy as np

from edgeprobe_kernels.linear_records import weight_blobs

# what a mobile NPU runs: integer GEMMs, and q4_0-tile (HMX tile layout, FP16 activations: NPU TTS paper §3)
NPU_KINDS = {"w8a8", "w8a8-shadow", "smoothquant", "q4_0-tile"}


def prefill_plan(manifest: dict, n_tokens: int, last_only: bool = True, float_lane: str = "cpu",
                 split: dict | None = None, batch: int = 1, session: bool = False, ffn_flash: dict | None = None,
                 experts_flash: dict | None = None) -> dict:
    """Plan for prefilling `n_tokens` tokens (run input "tokens": int32[n_tokens]) -> logits of the last
    token float32[1, vocab] (all tokens with last_only=False). float_lane: where linears that are not
    integer GEMMs (float, q4_0 W4A16) run: "cpu", or "gpu" (OpenCL, HeteroLLM's GPU side).

    split: HeteroLLM partitioning (§4.1): {matmul name ("attn_q", ..., "ffn_down"): schedule.hetero.Choice}
    runs each int8 GEMM across the `gpu` and `npu` lanes as the solver chose (see _split_linear); shadow
    outliers of w8a8-shadow stay on `cpu`. Needs int8 records (w8a8, w8a8-shadow).

    session: the run extends a decode session on the agent (its KV cache): positions start at the session's
    length, attention reads every key it holds. batch: sequences per run (input tokens int32[batch *
    n_tokens], sequence-major) -> logits float32[batch, vocab]. A decode step is n_tokens=1.

    ffn_flash: {"mode": "sparse" | "dense", "window": k} — each FFN is one `ffn_flash` op reading its neurons
    from the bundle on flash (LLM in a flash; needs neurons.add_bundles and a session).

    MoE models: each FFN is one `moe_ffn` op (router + routed experts). experts_flash: {"capacity",
    "policy", "preload_n"} reads experts from flash through the session's expert buffer (EdgeMoE §3.3;
    preloading needs attach_expert_streaming's predictor tables); None keeps every expert resident."""
    c = manifest["config"]
    if c.get("n_experts") and c.get("shared_expert_ffn"):
        raise NotImplementedError("shared experts (Qwen-MoE) are not in device plans yet; run that model on the host")
    if experts_flash is not None and not session:
        raise ValueError("experts from flash keep their buffer in a decode session (Device.generate / session)")
    T = manifest["tensors"]
    L = manifest["linears"]
    ops: list[dict] = []

    def add(name, kind, lane, inputs, layer=-1, **attrs):
        ops.append({"name": name, "kind": kind, "lane": lane, "inputs": inputs, "deps": [], "attrs": attrs,
                    "layer": layer, "chunk": 0})
        return {"op": name}

    def linear(name, x, layer):
        rec = L[name]
        choice = (split or {}).get(name.rsplit(".", 1)[-1])
        if choice is not None:
            if rec["kind"] not in ("w8a8", "w8a8-shadow"):
                raise ValueError(f"a HeteroLLM split needs int8 linears (w8a8, w8a8-shadow); {name} is {rec['kind']!r}")
            y = _split_linear(add, name, x, layer, rec, choice, n_tokens * batch)
            if rec["kind"] == "w8a8-shadow" and rec.get("shadow"):
                b = add(f"{name}.shadow", "linear", "cpu", [x], layer, rec=rec, part="shadow")
                return add(f"{name}.sum", "add", "cpu", [y, b], layer)
            return y
        if rec["kind"] == "w8a8-shadow" and rec.get("shadow"):
            a = add(f"{name}.int8", "linear", "npu", [x], layer, rec=rec, part="int8")
            b = add(f"{name}.shadow", "linear", "cpu", [x], layer, rec=rec, part="shadow")
            return add(f"{name}.sum", "add", "cpu", [a, b], layer)
        return add(name, "linear", "npu" if rec["kind"] in NPU_KINDS else float_lane, [x], layer, rec=rec)

    h, hd, eps = c["n_heads"], c["head_dim"], c["rms_eps"]
    x = add("embed", "embed", "cpu", [{"input": "tokens"}, {"blob": T["token_embd.weight"]}])
    for i in range(c["n_layers"]):
        p = f"blk.{i}"
        n = add(f"{p}.attn_norm", "rms_norm", "cpu", [x, {"blob": T[f"{p}.attn_norm.weight"]}], i, eps=eps)
        q = linear(f"{p}.attn_q", n, i)
        k = linear(f"{p}.attn_k", n, i)
        v = linear(f"{p}.attn_v", n, i)
        sa = {"session": True} if session else {}
        q = add(f"{p}.rope_q", "rope", "cpu", [q], i, heads=h, head_dim=hd, theta=c["rope_theta"], batch=batch, **sa)
        k = add(f"{p}.rope_k", "rope", "cpu", [k], i, heads=c["n_kv_heads"], head_dim=hd, theta=c["rope_theta"],
                batch=batch, **sa)
        a = add(f"{p}.attention", "attention", "cpu", [q, k, v], i, n_heads=h, n_kv_heads=c["n_kv_heads"], head_dim=hd,
                batch=batch, **({"kv_layer": i} if session else {}), **sa)
        o = linear(f"{p}.attn_output", a, i)
        x = add(f"{p}.attn_residual", "add", "cpu", [x, o], i)
        n = add(f"{p}.ffn_norm", "rms_norm", "cpu", [x, {"blob": T[f"{p}.ffn_norm.weight"]}], i, eps=eps)
        if c.get("n_experts"):
            d = add(f"{p}.moe_ffn", "moe_ffn", "cpu", [n, {"blob": _router_blob(L, i)}], i,
                    **_moe_attrs(manifest, i, experts_flash))
            x = add(f"{p}.ffn_residual", "add", "cpu", [x, d], i)
            continue
        if ffn_flash:
            nr = manifest.get("neurons", {}).get(str(i))
            if nr is None or not session:
                raise ValueError("ffn_flash needs neuron bundles (edgeprobe.neurons.add_bundles) and a decode session")
            d = add(f"{p}.ffn_flash", "ffn_flash", "cpu", [n] + [{"blob": nr[k]} for k in ("A", "B", "b")], i,
                    bundle=nr["bundle"], ffn_layer=i, cutoff=nr["cutoff"], window=int(ffn_flash.get("window", 5)),
                    mode=ffn_flash.get("mode", "sparse"))
            x = add(f"{p}.ffn_residual", "add", "cpu", [x, d], i)
            continue
        g = linear(f"{p}.ffn_gate", n, i)
        u = linear(f"{p}.ffn_up", n, i)
        act = add(f"{p}.swiglu", "swiglu", "cpu", [g, u], i)
        d = linear(f"{p}.ffn_down", act, i)
        x = add(f"{p}.ffn_residual", "add", "cpu", [x, d], i)
    n = add("output_norm", "rms_norm", "cpu", [x, {"blob": T["output_norm.weight"]}], eps=eps)
    head = T.get("output.weight", T["token_embd.weight"])
    add("lm_head", "lm_head", "cpu", [n, {"blob": head}], last_only=last_only, batch=batch)
    kind = "decode" if session and n_tokens == 1 else "prefill"
    return {"ops": ops, "outputs": ["lm_head"],
            "meta": {"kind": kind, "tokens": n_tokens, "batch": batch, "scheme": manifest["scheme"]}}


def _expert_recs(manifest: dict, layer: int) -> list:
    L = manifest["linears"]
    return [{p: L[f"blk.{layer}.ffn_{p}_exps.{e}"] for p in ("gate", "up", "down")}
            for e in range(manifest["config"]["n_experts"])]


def _router_blob(L: dict, layer: int) -> str:
    rec = L[f"blk.{layer}.ffn_gate_inp"]
    if rec.get("kind") != "float":
        raise ValueError(f"the agent runs float routers; blk.{layer}.ffn_gate_inp is {rec.get('kind')!r}")
    return rec["w"]


def _moe_attrs(manifest: dict, layer: int, flash: dict | None) -> dict:
    c = manifest["config"]
    a = {"moe_layer": layer, "n_layers": c["n_layers"], "k": c["n_experts_used"], "norm_topk": c.get("norm_topk", True),
         "experts": _expert_recs(manifest, layer), "flash": flash}
    if flash is not None:
        pred = manifest.get("expert_predictor")
        if (flash.get("preload_n") or flash.get("policy") == "edgemoe") and not pred:
            raise ValueError("preloading and the edgemoe policy need the co-activation tables: "
                             "attach_expert_streaming(qm, predictor) first")
        a["predictor"] = pred
        a["next_experts"] = _expert_recs(manifest, (layer + 1) % c["n_layers"])
    return a


def attach_expert_streaming(qm, predictor=None) -> None:
    """Mark `qm`'s expert weights as streamed from flash (not counted resident by the agent's memory budget)
    and add the preload predictor's tables (profile.experts.PreloadPredictor) as blobs."""
    c = qm.manifest["config"]
    if not c.get("n_experts"):
        raise ValueError("expert streaming is for MoE models")
    shas = set()
    for i in range(c["n_layers"]):
        for r in _expert_recs(qm.manifest, i):
            for rec in r.values():
                shas |= weight_blobs(rec)
    qm.manifest["streamed_blobs"] = sorted(shas)
    if predictor is not None:
        qm.manifest["expert_predictor"] = {k: (qm.store.put(np.asarray(v), f"expert_predictor.{k}") if np.ndim(v) else int(v))
                                           for k, v in predictor.to_arrays().items()}
        qm.manifest["blobs"] = qm.store.meta


def _npu_pieces(start: int, end: int, lengths) -> list:
    """Rows [start, end) cut into consecutive pieces, one per pre-built NPU length: (a, b, L), b - a <= L."""
    out, a = [], start
    for L in lengths:
        if a >= end:
            break
        out.append((a, min(a + L, end), L))
        a += L
    if a < end:
        raise ValueError(f"pre-built lengths {list(lengths)} do not cover rows {start}..{end}")
    return out


def _split_linear(add, name, x, layer, rec, ch, m):
    """One int8 GEMM as HeteroLLM's solver chose (strategy names of schedule.hetero): the NPU runs only
    pre-built lengths (pad_to: its rows are padded and computed), the GPU any shape."""
    N = int(rec["shape"][0])
    s = ch.strategy

    def npu(rows_a, rows_b, lengths, cols=None, tag="npu"):
        pieces = _npu_pieces(rows_a, rows_b, lengths)
        outs = [add(f"{name}.{tag}{j}", "linear", "npu", [x], layer, rec=rec, part="int8", rows=[a, b], pad_to=L,
                    **({"cols": list(cols)} if cols else {})) for j, (a, b, L) in enumerate(pieces)]
        return outs[0] if len(outs) == 1 else add(f"{name}.{tag}cat", "concat", "npu", outs, layer, axis=0)

    if s == "gpu":
        return add(f"{name}.gpu", "linear", "gpu", [x], layer, rec=rec, part="int8")
    if s in ("npu-pad", "pipe"):
        return npu(0, m, list(ch.npu_parts))
    if s == "seq-cut":
        a = npu(0, ch.npu_rows, list(ch.npu_parts))
        if ch.npu_rows >= m:
            return a
        b = add(f"{name}.gpu", "linear", "gpu", [x], layer, rec=rec, part="int8", rows=[ch.npu_rows, m])
        return add(f"{name}.cat", "concat", "cpu", [a, b], layer, axis=0)
    if s == "row-cut":
        a = npu(0, m, list(ch.npu_parts), cols=(0, ch.npu_cols))
        b = add(f"{name}.gpu", "linear", "gpu", [x], layer, rec=rec, part="int8", cols=[ch.npu_cols, N])
        return add(f"{name}.cat", "concat", "cpu", [a, b], layer, axis=1)
    raise ValueError(f"unknown partition strategy {s!r}")


def shadow_layers(manifest: dict) -> list[int]:
    """Layers whose Q/K/V linears keep shadow outliers (w8a8-shadow, not pruned)."""
    c = manifest["config"]
    return [l for l in range(c["n_layers"])
            if any(manifest["linears"][f"blk.{l}.{p}"].get("kind") == "w8a8-shadow" and manifest["linears"][f"blk.{l}.{p}"].get("shadow")
                   for p in ("attn_q", "attn_k", "attn_v"))]


def chunked_prefill_plan(manifest: dict, sched) -> dict:
    """The agent plan of a chunked prefill (mllm-NPU §3.2) laid out by a Schedule (§3.4).

    Each subgraph of the schedule's ChunkGraph becomes a few ops on the subgraph's lane:
      qkv     attn_norm + int8 Q/K/V GEMMs                      (npu)
      shadow  its own attn_norm + the shadow-outlier GEMMs of Q/K/V (cpu; recomputing the norm keeps its only
              dependency the previous layer, as in the graph)
      attn    int8 + shadow sums, RoPE at the chunk's offset, attention over the keys of chunks 0..i (cpu)
      ffn     output projection, residual, ffn_norm, FFN, residual (npu; the shadow outliers of these
              linears run fused with their int8 GEMM on that lane — a simplification of mllm-NPU)
    Each lane runs its ops in the order the schedule starts their subgraphs. Run input: "tokens".
    """
    g = sched.graph
    c = manifest["config"]
    T, L = manifest["tensors"], manifest["linears"]
    h, kvh, hd, eps, theta = c["n_heads"], c["n_kv_heads"], c["head_dim"], c["rms_eps"], c["rope_theta"]
    chunk = g.chunk_len
    ops_by_sub: dict[str, list] = {}

    def add(sub, name, kind, lane, inputs, layer, chunk_i, **attrs):
        ops_by_sub.setdefault(sub, []).append({"name": name, "kind": kind, "lane": lane, "inputs": inputs, "deps": [],
                                               "attrs": attrs, "layer": layer, "chunk": chunk_i, "group": sub})
        return {"op": name}

    def embed(sub, name, i):  # chunk i's token embeddings, computed in subgraph `sub`
        return add(sub.name, name, "embed", sub.lane, [{"input": "tokens"}, {"blob": T["token_embd.weight"]}], 0, i,
                   start=i * chunk, length=subs[f"c{i}.l0.qkv"].tokens)

    resid: dict = {}  # (chunk, layer) -> residual stream entering the layer
    subs = g.by_name()
    for i in range(g.n_chunks):
        resid[(i, 0)] = embed(subs[f"c{i}.l0.qkv"], f"c{i}.embed", i)
    for l in range(c["n_layers"]):
        for i in range(g.n_chunks):
            p, x = f"c{i}.l{l}", resid[(i, l)]
            qkv, at, ff = (subs[f"{p}.{s}"] for s in ("qkv", "attn", "ffn"))
            sh = subs.get(f"{p}.shadow")
            n = add(qkv.name, f"{p}.attn_norm", "rms_norm", qkv.lane, [x, {"blob": T[f"blk.{l}.attn_norm.weight"]}], l, i, eps=eps)
            parts, shadow_in = {}, None
            for proj in ("attn_q", "attn_k", "attn_v"):
                rec = L[f"blk.{l}.{proj}"]
                shadowed = rec["kind"] == "w8a8-shadow" and rec.get("shadow")
                if shadowed and sh is None:
                    raise ValueError(f"layer {l} keeps shadow outliers but the chunk graph has no shadow subgraph for it; "
                                     "build the graph with shadow=shadow_layers(manifest)")
                parts[proj] = [add(qkv.name, f"{p}.{proj}", "linear", qkv.lane, [n], l, i, rec=rec,
                                   part="int8" if shadowed else "all")]
                if shadowed:
                    if shadow_in is None:  # one norm for the Q/K/V shadows of this chunk and layer
                        # layer 0 embeds on its own: reading qkv's embedding is a dependency the schedule ignores
                        sx = embed(sh, f"{p}.shadow_embed", i) if l == 0 else x
                        shadow_in = add(sh.name, f"{p}.shadow_norm", "rms_norm", sh.lane,
                                        [sx, {"blob": T[f"blk.{l}.attn_norm.weight"]}], l, i, eps=eps)
                    parts[proj].append(add(sh.name, f"{p}.{proj}.shadow", "linear", sh.lane, [shadow_in], l, i, rec=rec,
                                           part="shadow"))
            qkv_out = {}
            for proj, ins in parts.items():
                qkv_out[proj] = add(at.name, f"{p}.{proj}.sum", "add", at.lane, ins, l, i) if len(ins) > 1 else ins[0]
            q = add(at.name, f"{p}.rope_q", "rope", at.lane, [qkv_out["attn_q"]], l, i, heads=h, head_dim=hd, theta=theta,
                    start=i * chunk)
            k = add(at.name, f"{p}.rope_k", "rope", at.lane, [qkv_out["attn_k"]], l, i, heads=kvh, head_dim=hd, theta=theta,
                    start=i * chunk)
            resid[("k", i, l)], resid[("v", i, l)] = k, qkv_out["attn_v"]
            ks = [resid[("k", j, l)] for j in range(i + 1)]
            vs = [resid[("v", j, l)] for j in range(i + 1)]
            a = add(at.name, f"{p}.attention", "attention", at.lane, [q] + ks + vs, l, i, n_heads=h, n_kv_heads=kvh,
                    head_dim=hd, start=i * chunk, parts=i + 1)
            o = add(ff.name, f"{p}.attn_output", "linear", ff.lane, [a], l, i, rec=L[f"blk.{l}.attn_output"])
            x = add(ff.name, f"{p}.attn_residual", "add", ff.lane, [x, o], l, i)
            n2 = add(ff.name, f"{p}.ffn_norm", "rms_norm", ff.lane, [x, {"blob": T[f"blk.{l}.ffn_norm.weight"]}], l, i, eps=eps)
            gt = add(ff.name, f"{p}.ffn_gate", "linear", ff.lane, [n2], l, i, rec=L[f"blk.{l}.ffn_gate"])
            up = add(ff.name, f"{p}.ffn_up", "linear", ff.lane, [n2], l, i, rec=L[f"blk.{l}.ffn_up"])
            act = add(ff.name, f"{p}.swiglu", "swiglu", ff.lane, [gt, up], l, i)
            dn = add(ff.name, f"{p}.ffn_down", "linear", ff.lane, [act], l, i, rec=L[f"blk.{l}.ffn_down"])
            resid[(i, l + 1)] = add(ff.name, f"{p}.ffn_residual", "add", ff.lane, [x, dn], l, i)
    last = g.n_chunks - 1
    tail_sub = f"c{last}.l{c['n_layers'] - 1}.ffn"
    lane = subs[tail_sub].lane
    n = add(tail_sub, "output_norm", "rms_norm", lane, [resid[(last, c["n_layers"])], {"blob": T["output_norm.weight"]}],
            -1, last, eps=eps)
    add(tail_sub, "lm_head", "lm_head", lane, [n, {"blob": T.get("output.weight", T["token_embd.weight"])}], -1, last,
        last_only=True)
    # plan order: subgraphs by scheduled start; each lane runs its ops in that order
    order = sorted(sched.slots, key=lambda s: (sched.slots[s][1], s))
    ops, lane_order = [], {}
    for sub in order:
        for op in ops_by_sub.get(sub, []):
            ops.append(op)
            lane_order.setdefault(op["lane"], []).append(op["name"])
    return {"ops": ops, "lane_order": lane_order, "outputs": ["lm_head"],
            "meta": {"kind": "chunked-prefill", "tokens": g.prompt_len, "chunk": chunk, "scheduler": sched.scheduler,
                     "profile": sched.profile.name}}
