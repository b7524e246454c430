"""Plans for the device agent, built from a QuantizedModel's manifest (pure data; see edgeprobe_agent.executor).

`prefill_plan` is the layer-by-layer prefill of one sequence: int8 linears on the `npu` lane (NPU
semantics, emulated on this CPU), their shadow-outlier GEMMs and every float op on `cpu`, so the two
lanes overlap wherever the dependencies allow (mllm-NPU §3.3's CPU/NPU split). The scheduling issue
replaces the order; the op vocabulary stays.
"""
from __future__ import annotations

NPU_KINDS = {"w8a8", "w8a8-shadow", "smoothquant"}  # integer GEMMs a mobile NPU runs


def prefill_plan(manifest: dict, n_tokens: int, last_only: bool = True, float_lane: str = "cpu") -> dict:
    """Plan for prefilling `n_tokens` tokens (run input "tokens": int32[n_tokens]) -> logits of the last
    token float32[1, vocab] (all tokens with last_only=False). float_lane: where linears that are not
    integer GEMMs (float, q4_0 W4A16) run: "cpu", or "gpu" (OpenCL, HeteroLLM's GPU side)."""
    c = manifest["config"]
    if c.get("n_experts"):
        raise NotImplementedError("device plans for MoE models arrive with the decode issue; run tiny-moe on the host")
    T = manifest["tensors"]
    L = manifest["linears"]
    ops: list[dict] = []

    def add(name, kind, lane, inputs, layer=-1, **attrs):
        ops.append({"name": name, "kind": kind, "lane": lane, "inputs": inputs, "deps": [], "attrs": attrs,
                    "layer": layer, "chunk": 0})
        return {"op": name}

    def linear(name, x, layer):
        rec = L[name]
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
        q = add(f"{p}.rope_q", "rope", "cpu", [q], i, heads=h, head_dim=hd, theta=c["rope_theta"])
        k = add(f"{p}.rope_k", "rope", "cpu", [k], i, heads=c["n_kv_heads"], head_dim=hd, theta=c["rope_theta"])
        a = add(f"{p}.attention", "attention", "cpu", [q, k, v], i, n_heads=h, n_kv_heads=c["n_kv_heads"], head_dim=hd)
        o = linear(f"{p}.attn_output", a, i)
        x = add(f"{p}.attn_residual", "add", "cpu", [x, o], i)
        n = add(f"{p}.ffn_norm", "rms_norm", "cpu", [x, {"blob": T[f"{p}.ffn_norm.weight"]}], i, eps=eps)
        g = linear(f"{p}.ffn_gate", n, i)
        u = linear(f"{p}.ffn_up", n, i)
        act = add(f"{p}.swiglu", "swiglu", "cpu", [g, u], i)
        d = linear(f"{p}.ffn_down", act, i)
        x = add(f"{p}.ffn_residual", "add", "cpu", [x, d], i)
    n = add("output_norm", "rms_norm", "cpu", [x, {"blob": T["output_norm.weight"]}], eps=eps)
    head = T.get("output.weight", T["token_embd.weight"])
    add("lm_head", "lm_head", "cpu", [n, {"blob": head}], last_only=last_only)
    return {"ops": ops, "outputs": ["lm_head"], "meta": {"kind": "prefill", "tokens": n_tokens, "scheme": manifest["scheme"]}}
