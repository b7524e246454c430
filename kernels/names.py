"""Tensor names, hook points and op kinds: one table that the forward pass, the graph template, the profilers,
the quantizers and the agent import.

Tensor names follow GGUF (llama.cpp's gguf-py `constants.py`): `blk.{i}.attn_q.weight` etc. A *linear*
is named without `.weight` ("blk.0.attn_q"); an expert's slice of a stacked tensor is
"blk.0.ffn_up_exps.3". Op kinds are what a plan may ask the agent to run (`edgeprobe_agent.ops.OPS`
implements exactly these).
"""
from __future__ import annotations

TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"          # absent when tied to the embedding
OUTPUT_NORM = "output_norm.weight"

ATTN_IN = ("attn_q", "attn_k", "attn_v")       # linears reading attn_norm's output (mllm-NPU's qkv subgraph)
ATTN_LINEARS = ATTN_IN + ("attn_output",)
FFN_LINEARS = ("ffn_gate", "ffn_up", "ffn_down")
ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # router linears: tiny, and they pick discrete experts


def blk(i: int, name: str) -> str:
    """blk(3, "attn_q") -> "blk.3.attn_q" (a linear or a hook point); add ".weight" for the tensor."""
    return f"blk.{i}.{name}"


def weight(name: str) -> str:
    return f"{name}.weight"


def matmul_of(linear: str) -> str:
    """"blk.3.attn_q" -> "attn_q": the per-layer matmul a HeteroLLM partition choice is keyed by."""
    return linear.rsplit(".", 1)[-1]


# Hook points: where the host's forward pass shows an activation x float32[rows, features] to a hook (which may
# replace it), named blk.{i}.<point> (out_norm alone), each at the output of a template op (last name part)
ATTN_IN_HOOK = "attn_in"      # input of Q/K/V: attn_norm's output              [N, hidden]
ATTN_OUT_HOOK = "attn_out"    # input of the output projection: the attention's [N, n_heads * head_dim]
FFN_IN_HOOK = "ffn_in"        # input of gate/up: ffn_norm's output              [N, hidden]
FFN_ACT_HOOK = "ffn_act"      # input of down: act(gate) * up                    [N, ffn]
ROUTER_HOOK = "router"        # MoE router logits (edgeprobe.forward.RouterLogits) [N, n_experts]
OUT_NORM_HOOK = "out_norm"    # input of the LM head: output_norm's output      [N, hidden]
LAYER_HOOKS = (ATTN_IN_HOOK, ATTN_OUT_HOOK, FFN_IN_HOOK, FFN_ACT_HOOK, ROUTER_HOOK)  # per layer, in execution order
HOOK_OPS = {ATTN_IN_HOOK: ("attn_norm",), ATTN_OUT_HOOK: ("attention",), FFN_IN_HOOK: ("ffn_norm",),
            FFN_ACT_HOOK: ("swiglu", "geglu"), ROUTER_HOOK: ("moe_ffn",), OUT_NORM_HOOK: ("output_norm",)}
LINEAR_HOOKS = (ATTN_IN_HOOK, ATTN_OUT_HOOK, FFN_IN_HOOK, FFN_ACT_HOOK)  # the points that are linears' inputs
INPUT_HOOK = {"attn_q": ATTN_IN_HOOK, "attn_k": ATTN_IN_HOOK, "attn_v": ATTN_IN_HOOK, "attn_output": ATTN_OUT_HOOK,
              "ffn_gate": FFN_IN_HOOK, "ffn_up": FFN_IN_HOOK, "ffn_down": FFN_ACT_HOOK}  # a dense linear's input point
_HOOK_OF_OP = {op: point for point, ops in HOOK_OPS.items() for op in ops}


def hook_point(op_name: str) -> str | None:
    """The hook point at a template op's output: "blk.3.swiglu" -> "blk.3.ffn_act", "output_norm" -> "out_norm",
    None for an op without one (the router's point is inside moe_ffn: its logits, not the op's output)."""
    head, _, last = op_name.rpartition(".")
    point = _HOOK_OF_OP.get(last)
    if point is None:
        return None
    return f"{head}.{point}" if head else point


def layer_of(name: str) -> int:
    """blk(3, ...) -> 3: the layer of a linear, a hook point or a tensor of the blk.{i} family."""
    return int(name.split(".")[1])


# op kind -> what it computes (x: float32[rows, features]); the agent's registry must match these keys
OP_KINDS = {
    "embed": "tokens int32[rows], table [vocab, hidden] -> float32[rows, hidden] (attrs start/length: a slice; scale)",
    "rms_norm": "x, w[hidden] -> x / rms(x) * w (attrs head_dim: each head's slice, w[head_dim])",
    "linear": "x -> x @ W^T as a quantized record computes it (attrs rec, part all|int8|shadow, rows/cols/pad_to)",
    "concat": "pieces of one linear's output joined on axis 0 (sequence cut) or 1 (row cut)",
    "rope": "q or k rows -> rotated at their positions (start, or the session's length)",
    "attention": "q, k.., v.. -> causal softmax attention (attrs session: over a decode session's cache; window; "
                 "scale, softcap: Gemma's score factor and Gemma 2's tanh cap)",
    "add": "a + b + ...",
    "swiglu": "gate, up -> silu(gate) * up",
    "geglu": "gate, up -> gelu_tanh(gate) * up (Gemma)",
    "sigmoid_mul": "x, g[rows, 1] -> x * sigmoid(g) (Qwen-MoE's shared-expert gate)",
    "moe_ffn": "x, router -> routed top-k SwiGLU experts mixed by router weights (EdgeMoE streaming in attrs)",
    "ffn_flash": "x, predictor A, B, b -> the FFN from the predicted-active neurons read from flash (LLM in a flash)",
    "lm_head": "x, W (or Q8_0 codes, scales) -> logits of the last position of each sequence (or every row; "
               "attrs softcap: Gemma 2's tanh cap)",
    "fused": "a run of one lane's consecutive ops of a layer, computed back to back (attrs ops; a decode step)",
}
