"""Dense ops: embedding, norms, RoPE, attention, elementwise, the LM head; each registers its kind (registry.op).

x: float32[rows, features], rows sequence-major (batch * T); kernels from `edgeprobe_kernels.llama_ops`, the same
the host's forward pass runs.
"""
from __future__ import annotations

import functools

import numpy as np

from edgeprobe_kernels.linear_records import x_wt
from edgeprobe_kernels.llama_ops import (
    add,
    apply_rope,
    attention,
    geglu_act,
    head_rms_norm,
    rms_norm,
    rope_tables,
    swiglu_act,
)
from edgeprobe_kernels.q8_0 import QK, matmul_q8_0

from .registry import OpError, _arr, op


@op("embed")
def op_embed(inp, attrs, ctx):
    """attrs start/length (optional): embed only that slice of the tokens (one chunk of a prompt)."""
    tokens, table = _arr(inp[0], "tokens", 1), _arr(inp[1], "table", 2)
    if "start" in attrs:
        tokens = tokens[int(attrs["start"]):int(attrs["start"]) + int(attrs["length"])]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= table.shape[0]):
        raise OpError("bad_input", f"token ids outside [0, {table.shape[0]})")
    x = np.asarray(table[tokens.astype(np.int64)], np.float32)
    return x * np.float32(attrs["scale"]) if "scale" in attrs else x  # Gemma scales by sqrt(hidden)


@op("rms_norm")
def op_rms_norm(inp, attrs, ctx):
    """attrs eps; head_dim: normalize each head's slice of x (Gemma 3's q/k norm) with w float32[head_dim]."""
    x, w = _arr(inp[0], "x", 2), _arr(inp[1], "w", 1)
    if "head_dim" in attrs:
        d = int(attrs["head_dim"])
        if d < 1 or x.shape[1] % d or w.shape[0] != d:
            raise OpError("bad_input", f"rms_norm per head of {d} needs x[rows, heads*{d}] and w[{d}], got {x.shape}, "
                                       f"{w.shape}")
        return head_rms_norm(x, w, float(attrs["eps"]), d)
    return rms_norm(x, w, float(attrs["eps"]))


@op("concat")
def op_concat(inp, attrs, ctx):
    """Pieces of one linear's output joined back: axis 0 (sequence cut) or 1 (row cut)."""
    axis = attrs.get("axis", 0)
    if axis not in (0, 1):
        raise OpError("bad_attrs", f"concat axis must be 0 or 1, got {str(axis)[:20]}")
    parts = [_arr(a, "part", 2) for a in inp]
    if len({p.shape[1 - axis] for p in parts}) != 1:
        raise OpError("bad_input", f"concat along axis {axis} needs equal sizes on the other axis, got "
                                   f"{[p.shape for p in parts]}")
    return np.concatenate(parts, axis=axis)


def _session_start(attrs, ctx) -> int:
    """Position of the run's first token: attrs start, or the session's length (a decode step; plus the step's
    offset in a decode loop)."""
    if attrs.get("session"):
        if ctx.session is None:
            raise OpError("no_session", "the plan reads a decode session but the run named none")
        return ctx.session.length + ctx.offset
    return int(attrs.get("start", 0))


@functools.lru_cache(maxsize=256)
def _rope_tables(d, theta, start, T, factors):
    """rope_tables, kept: a decode step's 2 x n_layers rope ops share one position (lru_cache is thread-safe)."""
    return rope_tables(d, theta, start, T, factors)


@op("rope")
def op_rope(inp, attrs, ctx):
    """x: float32[batch * T, heads * head_dim], rows sequence-major; positions from start (or the session)."""
    x = _arr(inp[0], "x", 2)
    h, d, B = int(attrs["heads"]), int(attrs["head_dim"]), int(attrs.get("batch", 1))
    if x.shape[0] % B:
        raise OpError("bad_input", f"{x.shape[0]} rows do not split into batch {B}")
    T = x.shape[0] // B
    ff = attrs.get("freq_factors")
    cos, sin = _rope_tables(d, float(attrs["theta"]), _session_start(attrs, ctx), T, tuple(ff) if ff else None)
    return apply_rope(x.reshape(B, T, h, d), cos, sin).reshape(x.shape[0], h * d)


@op("attention")
def op_attention(inp, attrs, ctx):
    """inputs q, k, v — or, for chunk i of a chunked prefill, q, k_0..k_i, v_0..v_i (attrs parts = i + 1):
    the chunk's queries attend to the keys of every chunk so far (mllm-NPU eq. 2), causally from `start`.
    attrs session + layer (+ batch B): k, v of the new positions go into the run's KV session, and the queries
    attend over everything the session holds (attrs kv_layer: which layer of it): prefill, then decode steps."""
    parts = int(attrs.get("parts", 1))
    if len(inp) != 1 + 2 * parts:
        raise OpError("bad_input", f"attention over {parts} chunks takes {1 + 2 * parts} inputs, got {len(inp)}")
    q = _arr(inp[0], "q", 2)
    k = np.concatenate([_arr(a, "k", 2) for a in inp[1:1 + parts]]) if parts > 1 else _arr(inp[1], "k", 2)
    v = np.concatenate([_arr(a, "v", 2) for a in inp[1 + parts:]]) if parts > 1 else _arr(inp[2], "v", 2)
    H, KV, d = int(attrs["n_heads"]), int(attrs["n_kv_heads"]), int(attrs["head_dim"])
    B = int(attrs.get("batch", 1))
    if q.shape[0] % B or k.shape[0] % B:
        raise OpError("bad_input", f"rows do not split into batch {B}")
    T, S = q.shape[0] // B, k.shape[0] // B
    start = _session_start(attrs, ctx)
    if attrs.get("session"):
        kk, vv = ctx.session.write(int(attrs["kv_layer"]), start, k.reshape(B, S, KV, d), v.reshape(B, S, KV, d))
    else:
        kk = k.reshape(B, S, KV, d).transpose(0, 2, 1, 3)
        vv = v.reshape(B, S, KV, d).transpose(0, 2, 1, 3)
    return attention(q.reshape(B, T, H, d), kk, vv, start, int(attrs.get("window", 0)), float(attrs.get("scale", 0.0)),
                     float(attrs.get("softcap", 0.0))).reshape(B * T, H * d)


@op("add")
def op_add(inp, attrs, ctx):
    return add(_arr(inp[0], "a"), *(_arr(b, "b") for b in inp[1:]))


@op("swiglu")
def op_swiglu(inp, attrs, ctx):
    return swiglu_act(_arr(inp[0], "gate", 2), _arr(inp[1], "up", 2))


@op("geglu")
def op_geglu(inp, attrs, ctx):
    return geglu_act(_arr(inp[0], "gate", 2), _arr(inp[1], "up", 2))


@op("sigmoid_mul")
def op_sigmoid_mul(inp, attrs, ctx):
    """x float32[rows, n] * sigmoid(g float32[rows, 1]): Qwen-MoE's gate on its shared expert."""
    x, g = _arr(inp[0], "x", 2), _arr(inp[1], "g", 2)
    if g.shape != (x.shape[0], 1):
        raise OpError("bad_input", f"sigmoid_mul gates rows of x {x.shape} by g[rows, 1], got g {g.shape}")
    return x * (1.0 / (1.0 + np.exp(-g)))


@op("lm_head")
def op_lm_head(inp, attrs, ctx):
    """inputs x, W float32[vocab, hidden] — or x, codes int8[vocab, hidden], scales float32[vocab, hidden/32]: a
    Q8_0 head as llama.cpp runs it (kernels/q8_0.py). last_only: the last position of each of `batch` sequences
    -> float32[batch, vocab]."""
    if len(inp) not in (2, 3):
        raise OpError("bad_input", f"lm_head takes x and W, or x, Q8_0 codes and scales; got {len(inp)} inputs")
    x, w = _arr(inp[0], "x", 2), _arr(inp[1], "w", 2)
    B = int(attrs.get("batch", 1))
    if attrs.get("last_only", True):
        x = x.reshape(B, x.shape[0] // B, x.shape[1])[:, -1]
    if len(inp) == 3:
        d = _arr(inp[2], "scales", 2)
        if w.dtype != np.int8 or w.shape[1] != x.shape[1] or d.shape != (w.shape[0], x.shape[1] // QK):
            raise OpError("bad_input", f"a Q8_0 head needs codes int8[vocab, {x.shape[1]}] and scales "
                                       f"[vocab, {x.shape[1] // QK}], got {w.dtype}{w.shape} and {d.shape}")
        return softcap_logits(matmul_q8_0(x, w, d), attrs)
    return softcap_logits(x_wt(x, w), attrs)


def softcap_logits(y: np.ndarray, attrs) -> np.ndarray:
    """Logits soft-capped as Gemma 2's are (attrs softcap > 0: tanh(y / cap) * cap), else y itself."""
    cap = np.float32(attrs.get("softcap", 0.0))
    return np.tanh(y / cap) * cap if cap else y

