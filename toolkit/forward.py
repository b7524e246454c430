"""The one forward pass: a float32 Llama-family decoder in numpy, with a KV cache and hook points.

Every later stage goes through here: profilers read activations at the hook points, quantizers
replace them (a hook may return a new array) or replace the linears (`linear=`), MoE models plug
their FFN into `FFN_KINDS`. There is no second transformer anywhere in edgeprobe.

Hook points, each seeing x: float32[batch*tokens, features] (rows in batch-major order):
    blk.{i}.attn_in   input of Q/K/V (after attn_norm)         [N, hidden]
    blk.{i}.attn_out  input of the output projection           [N, n_heads*head_dim]
    blk.{i}.ffn_in    input of gate/up (after ffn_norm)        [N, hidden]
    blk.{i}.ffn_act   input of down: silu(gate) * up           [N, ffn]
    blk.{i}.router    MoE router logits (MoE models)           [N, n_experts]
    out_norm          input of the LM head (after output_norm) [N, hidden]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

import numpy as np

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

    def nbytes(self) -> int:
        c = self.config
        return 2 * c.n_layers * self.batch * c.n_kv_heads * self.length * c.head_dim * 4


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: float32[N, C], w: float32[C] -> x / rms(x) * w (RMSNorm, Zhang & Sennrich 2019)."""
    ms = np.einsum("nc,nc->n", x, x) / x.shape[1]
    return x * (1.0 / np.sqrt(ms + eps))[:, None].astype(np.float32) * w


def rope_tables(config: ModelConfig, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: float32[length, head_dim/2] for positions start..start+length-1 (RoFormer eq. 34)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = np.arange(start, start + length, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: float32[B, T, heads, head_dim], rotating adjacent pairs (2i, 2i+1) — the GGUF layout."""
    B, T, H, d = x.shape
    xp = x.reshape(B, T, H, d // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = np.empty_like(xp)
    out[..., 0] = x0 * c - x1 * s
    out[..., 1] = x0 * s + x1 * c
    return out.reshape(B, T, H, d)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal grouped-query attention.

    q: float32[B, T, n_heads, d] at positions start..start+T-1; k, v: float32[B, n_kv, S, d] with
    S = start + T. Query head h reads KV head h // (n_heads / n_kv). Returns float32[B*T, n_heads*d].
    """
    B, T, H, d = q.shape
    KV, S = k.shape[1], k.shape[2]
    G = H // KV
    # The G query heads of a KV head share its keys: one GEMM of M = G*T rows per KV head.
    qg = q.transpose(0, 2, 1, 3).reshape(B, KV, G * T, d) * np.float32(1.0 / np.sqrt(d))
    scores = np.matmul(qg, k.swapaxes(-1, -2))  # [B, KV, G*T, S]
    if T > 1:
        mask = np.where(np.arange(S)[None, :] > (start + np.arange(T))[:, None], -np.inf, 0.0).astype(np.float32)
        scores.reshape(B, KV, G, T, S)[...] += mask
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v)  # [B, KV, G*T, d]
    return out.reshape(B, H, T, d).transpose(0, 2, 1, 3).reshape(B * T, H * d)


def float_linear(model: Model) -> LinearFn:
    """The reference linear: y = x @ W.T with W float32[out, in] (x: float32[N, in] -> [N, out])."""
    def linear(name: str, x: np.ndarray) -> np.ndarray:
        return x @ model.weights[name + ".weight"].T
    return linear


def dense_ffn(model: Model, i: int, x: np.ndarray, hooks: Hooks, linear: LinearFn) -> np.ndarray:
    """SwiGLU FFN (Shazeer 2020): down(silu(gate(x)) * up(x)); x: float32[N, hidden]."""
    g = linear(f"blk.{i}.ffn_gate", x)
    u = linear(f"blk.{i}.ffn_up", x)
    act = g / (1.0 + np.exp(-g)) * u
    act = _hook(hooks, f"blk.{i}.ffn_act", act)
    return linear(f"blk.{i}.ffn_down", act)


# FFN implementations by kind; the MoE issue registers "moe" here rather than forking the pass.
FFN_KINDS: dict[str, Callable] = {"dense": dense_ffn}


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
            linear: LinearFn | None = None, logits: str = "all") -> np.ndarray:
    """Run tokens through the model, appending to `cache` if given (prefill or decode).

    tokens: int[T] or int[B, T], at positions cache.length..cache.length+T-1.
    logits: "all" -> float32[(B,) T, vocab]; "last" -> float32[(B,) vocab] for the last position;
            "none" -> the final normed hidden state float32[(B,) T, hidden] (no LM head).
    hooks: a callable hook(name, x) for every point, or a dict name -> hook(name, x); see module doc.
    linear: replaces the float linears, e.g. by a quantized simulation: linear(name, x) -> y.
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
    W = model.weights
    x = np.asarray(W["token_embd.weight"][toks.reshape(-1)], dtype=np.float32)  # [N, hidden]
    cos, sin = rope_tables(c, start, T)
    if cache is not None:
        cache.reserve(start + T)
    ffn = FFN_KINDS[ffn_kind(c)]
    d = c.head_dim
    for i in range(c.n_layers):
        h = rms_norm(x, W[f"blk.{i}.attn_norm.weight"], c.rms_eps)
        h = _hook(hooks, f"blk.{i}.attn_in", h)
        q = linear(f"blk.{i}.attn_q", h).reshape(B, T, c.n_heads, d)
        k = linear(f"blk.{i}.attn_k", h).reshape(B, T, c.n_kv_heads, d)
        v = linear(f"blk.{i}.attn_v", h).reshape(B, T, c.n_kv_heads, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache.k[i][:, :, start:start + T] = k.transpose(0, 2, 1, 3)
            cache.v[i][:, :, start:start + T] = v.transpose(0, 2, 1, 3)
            kk, vv = cache.k[i][:, :, :start + T], cache.v[i][:, :, :start + T]
        else:
            kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        a = attention(q, kk, vv, start)
        a = _hook(hooks, f"blk.{i}.attn_out", a)
        x = x + linear(f"blk.{i}.attn_output", a)
        h = rms_norm(x, W[f"blk.{i}.ffn_norm.weight"], c.rms_eps)
        h = _hook(hooks, f"blk.{i}.ffn_in", h)
        x = x + ffn(model, i, h, hooks, linear)
    if cache is not None:
        cache.length = start + T
    x = rms_norm(x, W["output_norm.weight"], c.rms_eps)
    x = _hook(hooks, "out_norm", x)
    if logits == "none":
        out = x.reshape(B, T, -1)
    elif logits == "last":
        out = (x.reshape(B, T, -1)[:, -1] @ model.output_weight.T)
    elif logits == "all":
        out = (x @ model.output_weight.T).reshape(B, T, -1)
    else:
        raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
    return out[0] if single else out
