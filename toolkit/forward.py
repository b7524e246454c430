"""The one forward pass: a float32 Llama-family decoder in numpy, with a KV cache and hook points.

Every later stage goes through here: profilers read activations at the hook points, quantizers
replace them (a hook may return a new array) or replace the linears (`linear=`), MoE models plug
their FFN into `FFN_KINDS`. There is no second transformer anywhere in edgeprobe.

Hook points, each seeing x: float32[batch*tokens, features] (rows in batch-major order):
    blk.{i}.attn_in   input of Q/K/V (after attn_norm)         [N, hidden]
    blk.{i}.attn_out  input of the output projection           [N, n_heads*head_dim]
    blk.{i}.ffn_in    input of gate/up (after ffn_norm)        [N, hidden]
    blk.{i}.ffn_act   input of down: silu(gate) * up           [N, ffn]
    blk.{i}.router    MoE router logits (MoE models)           [N, n_experts], a RouterLogits whose
                      .experts int64[N, k] and .weights float32[N, k] are the routing they imply
    out_norm          input of the LM head (after output_norm) [N, hidden]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

import numpy as np

from edgeprobe_kernels.llama_ops import GATED_ACTS, apply_rope, attention, head_rms_norm, rms_norm, route
from edgeprobe_kernels.llama_ops import rope_tables as _rope_tables
from edgeprobe_kernels.names import ATTN_LINEARS, FFN_LINEARS
from edgeprobe_kernels.names import ROUTERS  # noqa: F401  (re-exported: router linears stay float)

from .errors import TokenRangeError
from .models import Model, ModelConfig

HookFn = Callable[[str, np.ndarray], Union[np.ndarray, None]]
Hooks = Union[HookFn, Mapping[str, HookFn], None]
LinearFn = Callable[[str, np.ndarray], np.ndarray]

HOOK_POINTS = ("attn_in", "attn_out", "ffn_in", "ffn_act", "router")


def hook_names(config: ModelConfig) -> list[str]:
    """Every hook point name of a model, in execution order."""
    per = [p for p in HOOK_POINTS if p != "router" or config.n_experts]
    return [f"blk.{i}.{p}" for i in range(config.n_layers) for p in per] + ["out_norm"]


def _hook(hooks: Hooks, name: str, x: np.ndarray) -> np.ndarray:
    """Call the hook for `name` (a callable for all points, or a dict by name); it may replace x."""
    if hooks is None:
        return x
    fn = hooks if callable(hooks) else hooks.get(name)
    if fn is None:
        return x
    out = fn(name, x)
    if out is None:
        return x
    if out.shape != x.shape:
        raise ValueError(f"hook at {name} returned shape {out.shape}; it must keep the shape {x.shape}")
    return np.asarray(out, dtype=np.float32)


@dataclass
class KVCache:
    """Per-layer keys and values: float32[batch, n_kv_heads, capacity, head_dim], filled to `length`."""

    config: ModelConfig
    batch: int = 1
    length: int = 0
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)

    def reserve(self, total: int) -> None:
        """Grow capacity (doubling) so that `total` positions fit."""
        cap = self.k[0].shape[2] if self.k else 0
        if total <= cap:
            return
        c = self.config
        new_cap = max(total, 2 * cap, 64)
        shape = (self.batch, c.n_kv_heads, new_cap, c.head_dim)
        for store in (self.k, self.v):
            old = list(store) or [None] * c.n_layers
            store[:] = []
            for o in old:
                a = np.zeros(shape, dtype=np.float32)
                if o is not None:
                    a[:, :, :self.length] = o[:, :, :self.length]
                store.append(a)

    def reorder(self, indices) -> None:
        """New batch row j = old row indices[j]: fork one prompt into candidates, or keep surviving beams."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1 or idx.size == 0 or idx.min() < 0 or idx.max() >= self.batch:
            raise ValueError(f"reorder indices must be a non-empty list of rows in [0, {self.batch})")
        self.k[:] = [np.ascontiguousarray(a[idx]) for a in self.k]
        self.v[:] = [np.ascontiguousarray(a[idx]) for a in self.v]
        self.batch = int(idx.size)

    def nbytes(self) -> int:
        c = self.config
        return 2 * c.n_layers * self.batch * c.n_kv_heads * self.length * c.head_dim * 4


def rope_tables(config: ModelConfig, start: int, length: int, layer: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: float32[length, head_dim/2] for positions start..start+length-1 (layer: its own RoPE base)."""
    return _rope_tables(config.head_dim, config.theta(layer) if layer >= 0 else config.rope_theta, start, length,
                        config.rope_freq_factors)


def float_linear(model: Model) -> LinearFn:
    """The reference linear: y = x @ W.T with W float32[out, in] (x: float32[N, in] -> [N, out]).

    Expert linears are named "blk.{i}.ffn_up_exps.{e}": expert e's slice of the stacked tensor.
    """
    def linear(name: str, x: np.ndarray) -> np.ndarray:
        return x @ model.linear_weight(name).T
    return linear


def is_router(name: str) -> bool:
    return name.endswith(ROUTERS)


def linear_tensor(name: str) -> str:
    """The tensor holding a linear: "blk.0.attn_q" -> "blk.0.attn_q.weight"; an expert linear
    "blk.0.ffn_up_exps.3" -> its stacked "blk.0.ffn_up_exps.weight"."""
    return f"{name.rpartition('.')[0] if '_exps.' in name else name}.weight"


def linear_names(config: ModelConfig) -> list[str]:
    """Every linear the forward pass calls, in execution order (experts one by one, then shared)."""
    out = []
    for i in range(config.n_layers):
        out += [f"blk.{i}.{op}" for op in ATTN_LINEARS]
        if not config.n_experts:
            out += [f"blk.{i}.{op}" for op in FFN_LINEARS]
            continue
        out.append(f"blk.{i}.ffn_gate_inp")
        out += [f"blk.{i}.ffn_{op}_exps.{e}" for e in range(config.n_experts) for op in ("gate", "up", "down")]
        if config.shared_expert_ffn:
            out += [f"blk.{i}.ffn_{op}_shexp" for op in ("gate", "up", "down")]
            if config.shared_expert_gate:
                out.append(f"blk.{i}.ffn_gate_inp_shexp")
    return out


def dense_ffn(model: Model, i: int, x: np.ndarray, hooks: Hooks, linear: LinearFn) -> np.ndarray:
    """Gated FFN (Shazeer 2020): down(act(gate(x)) * up(x)), act silu (SwiGLU) or tanh-GELU (GeGLU, Gemma);
    x: float32[N, hidden]."""
    act = GATED_ACTS[model.config.act_fn](linear(f"blk.{i}.ffn_gate", x), linear(f"blk.{i}.ffn_up", x))
    act = _hook(hooks, f"blk.{i}.ffn_act", act)
    return linear(f"blk.{i}.ffn_down", act)


class RouterLogits(np.ndarray):
    """Router logits float32[N, n_experts] that also carry the routing they imply:
    `.experts` int64[N, k] (the chosen experts, best first) and `.weights` float32[N, k]."""

    experts: np.ndarray
    weights: np.ndarray


def _router_hook(hooks: Hooks, name: str, logits: np.ndarray, k: int, norm: bool):
    experts, weights = route(logits, k, norm)
    if hooks is None:
        return experts, weights
    x = logits.view(RouterLogits)
    x.experts, x.weights = experts, weights
    out = _hook(hooks, name, x)
    if out is x:
        return experts, weights
    return route(out, k, norm)  # the hook replaced the logits: route by the new ones


def swiglu(linear: LinearFn, prefix: str, suffix: str, x: np.ndarray) -> np.ndarray:
    """down(silu(gate(x)) * up(x)) through linears named f"{prefix}ffn_gate{suffix}" etc."""
    act = GATED_ACTS["silu"](linear(f"{prefix}ffn_gate{suffix}", x), linear(f"{prefix}ffn_up{suffix}", x))
    return linear(f"{prefix}ffn_down{suffix}", act)


def moe_ffn(model: Model, i: int, x: np.ndarray, hooks: Hooks, linear: LinearFn) -> np.ndarray:
    """Mixture-of-experts FFN (Mixtral / OLMoE / Qwen-MoE style); x: float32[N, hidden].

    A softmax router picks top-k SwiGLU experts per token and mixes their outputs by the (optionally
    renormalized) router probabilities; an optional shared expert runs on every token, scaled by
    sigmoid(ffn_gate_inp_shexp · x) when that gate exists (Qwen-MoE). Each expert's GEMM sees only
    the rows routed to it, as on a device that loads just the chosen experts (EdgeMoE §3.3).
    """
    c = model.config
    logits = linear(f"blk.{i}.ffn_gate_inp", x)
    experts, weights = _router_hook(hooks, f"blk.{i}.router", logits, c.n_experts_used, c.norm_topk)
    y = np.zeros_like(x)
    for e in range(c.n_experts):
        rows, slot = np.nonzero(experts == e)
        if len(rows) == 0:
            continue
        # a token picks an expert at most once, so rows are unique and += is a scatter-add
        y[rows] += weights[rows, slot, None] * swiglu(linear, f"blk.{i}.", f"_exps.{e}", x[rows])
    if c.shared_expert_ffn:
        s = swiglu(linear, f"blk.{i}.", "_shexp", x)
        if c.shared_expert_gate:
            s *= 1.0 / (1.0 + np.exp(-linear(f"blk.{i}.ffn_gate_inp_shexp", x)))
        y += s
    return y


# FFN implementations by kind: dense SwiGLU or mixture of experts, in the one forward pass.
FFN_KINDS: dict[str, Callable] = {"dense": dense_ffn, "moe": moe_ffn}


def ffn_kind(config: ModelConfig) -> str:
    return "moe" if config.n_experts else "dense"


def _as_batch(tokens, vocab: int) -> tuple[np.ndarray, bool]:
    t = np.asarray(tokens)
    if t.size == 0:
        raise TokenRangeError(f"tokens must have shape [tokens] or [batch, tokens] with at least one token, "
                              f"got {t.shape}")
    if t.dtype.kind not in "iu":
        raise TokenRangeError(f"token ids must be integers, got dtype {t.dtype}; encode text with model.tokenizer")
    single = t.ndim == 1
    t = t[None, :] if single else t
    if t.ndim != 2 or t.shape[1] == 0:
        raise TokenRangeError(f"tokens must have shape [tokens] or [batch, tokens] with at least one token, "
                              f"got {tuple(np.shape(tokens))}")
    if t.size and (t.min() < 0 or t.max() >= vocab):
        bad = t[(t < 0) | (t >= vocab)]
        raise TokenRangeError(f"token ids {bad[:5].tolist()} are outside the vocabulary [0, {vocab}); "
                              "encode text with this model's tokenizer")
    return t.astype(np.int64), single


def forward(model: Model, tokens, cache: KVCache | None = None, hooks: Hooks = None,
            linear: LinearFn | None = None, logits: str = "all", head=None) -> np.ndarray:
    """Run tokens through the model, appending to `cache` if given (prefill or decode).

    tokens: int[T] or int[B, T], at positions cache.length..cache.length+T-1.
    logits: "all" -> float32[(B,) T, vocab]; "last" -> float32[(B,) vocab] for the last position;
            "none" -> the final normed hidden state float32[(B,) T, hidden] (no LM head).
    hooks: a callable hook(name, x) for every point, or a dict name -> hook(name, x); see module doc.
    linear: replaces the float linears, e.g. by a quantized simulation: linear(name, x) -> y.
    head: replaces the LM head: head(x float32[M, hidden]) -> float32[M, vocab] (a quantized model's Q8_0 head).
    """
    c = model.config
    toks, single = _as_batch(tokens, c.vocab_size)
    B, T = toks.shape
    if cache is not None and cache.batch != B:
        raise ValueError(f"the KV cache holds {cache.batch} sequences but tokens have batch {B}")
    start = cache.length if cache is not None else 0
    if start + T > c.context_length:
        raise TokenRangeError(f"{start + T} positions exceed the model's context length {c.context_length}; "
                              "use shorter windows or reset the cache")
    linear = linear or float_linear(model)
    head = head or model.head
    W = model.weights
    x = np.asarray(W["token_embd.weight"][toks.reshape(-1)], dtype=np.float32)  # [N, hidden]
    if c.embed_scale != 1.0:
        x = x * np.float32(c.embed_scale)  # Gemma: embeddings times sqrt(hidden)
    tables = {th: _rope_tables(c.head_dim, th, start, T, c.rope_freq_factors) for th in {c.theta(i) for i in range(c.n_layers)}}
    if cache is not None:
        cache.reserve(start + T)
    ffn = FFN_KINDS[ffn_kind(c)]
    d = c.head_dim
    for i in range(c.n_layers):
        h = rms_norm(x, W[f"blk.{i}.attn_norm.weight"], c.rms_eps)
        h = _hook(hooks, f"blk.{i}.attn_in", h)
        q, k, v = linear(f"blk.{i}.attn_q", h), linear(f"blk.{i}.attn_k", h), linear(f"blk.{i}.attn_v", h)
        if c.attn_bias:  # Qwen2: biases on Q, K and V
            q, k, v = (y + W[f"blk.{i}.{n}.bias"] for y, n in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")))
        if c.qk_norm:  # Gemma 3: each query and key head RMS-normalized before RoPE
            q = head_rms_norm(q, W[f"blk.{i}.attn_q_norm.weight"], c.rms_eps, d)
            k = head_rms_norm(k, W[f"blk.{i}.attn_k_norm.weight"], c.rms_eps, d)
        q, k = q.reshape(B, T, c.n_heads, d), k.reshape(B, T, c.n_kv_heads, d)
        v = v.reshape(B, T, c.n_kv_heads, d)
        cos, sin = tables[c.theta(i)]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache.k[i][:, :, start:start + T] = k.transpose(0, 2, 1, 3)
            cache.v[i][:, :, start:start + T] = v.transpose(0, 2, 1, 3)
            kk, vv = cache.k[i], cache.v[i]  # whole: attention() reads the first start + T positions
        else:
            kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        a = attention(q, kk, vv, start, c.window(i))
        a = _hook(hooks, f"blk.{i}.attn_out", a)
        o = linear(f"blk.{i}.attn_output", a)
        if c.post_norms:
            o = rms_norm(o, W[f"blk.{i}.post_attention_norm.weight"], c.rms_eps)
        x = x + o
        h = rms_norm(x, W[f"blk.{i}.ffn_norm.weight"], c.rms_eps)
        h = _hook(hooks, f"blk.{i}.ffn_in", h)
        f = ffn(model, i, h, hooks, linear)
        if c.post_norms:
            f = rms_norm(f, W[f"blk.{i}.post_ffw_norm.weight"], c.rms_eps)
        x = x + f
    if cache is not None:
        cache.length = start + T
    x = rms_norm(x, W["output_norm.weight"], c.rms_eps)
    x = _hook(hooks, "out_norm", x)
    if logits == "none":
        out = x.reshape(B, T, -1)
    elif logits == "last":
        last = x.reshape(B, T, -1)[:, -1]
        out = head(np.ascontiguousarray(last)) if head else last @ model.output_weight.T
    elif logits == "all":
        out = (head(x) if head else x @ model.output_weight.T).reshape(B, T, -1)
    else:
        raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
    return out[0] if single else out
