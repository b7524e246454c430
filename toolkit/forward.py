"""The host's float pass: the template's ops (graph.template) run in-process by the agent's executor, with hooks.

Every later stage goes through here: profilers read activations at the hook points, quantizers replace them (a
hook may return a new array) or replace the linears (`linear=`). The layer structure is the template's alone: this
module supplies the host's linear (float, or the caller's), its LM head and the hooks, as op functions over the
agent's registry (graph.local.float_plan / run_float).

Hook points (edgeprobe_kernels.names, the one table), each seeing x: float32[batch*tokens, features] (rows in
batch-major order), at the output of the template op named in names.HOOK_OPS:
    blk.{i}.attn_in   input of Q/K/V (after attn_norm)         [N, hidden]
    blk.{i}.attn_out  input of the output projection           [N, n_heads*head_dim]
    blk.{i}.ffn_in    input of gate/up (after ffn_norm)        [N, hidden]
    blk.{i}.ffn_act   input of down: silu(gate) * up           [N, ffn]
    blk.{i}.router    MoE router logits (MoE models)           [N, n_experts], a RouterLogits whose
                      .experts int64[N, k] and .weights float32[N, k] are the routing they imply
    out_norm          input of the LM head (after output_norm) [N, hidden]
A dict of hooks may also name any other op of the template ("blk.1.ffn_moe_sum": a MoE layer's FFN output).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

import numpy as np

from edgeprobe_agent.ops import OPS
from edgeprobe_agent.ops.dense import softcap_logits
from edgeprobe_kernels import names as N
from edgeprobe_kernels.llama_ops import GATED_ACTS, mix_experts, route  # noqa: F401  (route: re-exported)
from edgeprobe_kernels.llama_ops import rope_tables as _rope_tables
from edgeprobe_kernels.names import (
    ATTN_LINEARS,
    FFN_LINEARS,
    ROUTERS,  # noqa: F401  (re-exported: router linears stay float)
)
from edgeprobe_kernels.threads import host_pass, matmul_wt, settle

from .errors import TokenRangeError
from .graph.local import HostContext, HostRaised, float_plan, run_float, run_float_part
from .models import Model, ModelConfig

HookFn = Callable[[str, np.ndarray], Union[np.ndarray, None]]
Hooks = Union[HookFn, Mapping[str, HookFn], None]
LinearFn = Callable[[str, np.ndarray], np.ndarray]

HOOK_POINTS = N.LAYER_HOOKS  # per layer, in execution order (out_norm after the last layer)


def hook_names(config: ModelConfig) -> list[str]:
    """Every hook point name of a model, in execution order."""
    per = [p for p in HOOK_POINTS if p != N.ROUTER_HOOK or config.n_experts]
    return [N.blk(i, p) for i in range(config.n_layers) for p in per] + [N.OUT_NORM_HOOK]


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

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray):
        """k, v: float32[batch, T, n_kv_heads, head_dim] at positions start..start+T-1 (reserved) -> the layer's
        whole keys and values (the attention op reads the first start+T), as the agent's KVSession.write."""
        T = k.shape[1]
        self.k[layer][:, :, start:start + T] = k.transpose(0, 2, 1, 3)
        self.v[layer][:, :, start:start + T] = v.transpose(0, 2, 1, 3)
        return self.k[layer], self.v[layer]

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
        return matmul_wt(x, model.linear_weight(name))  # the same bits at any thread count (host passes)
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
    """The routed experts of layer i's MoE FFN (Mixtral / OLMoE / Qwen-MoE; the template's moe_ffn op, its shared
    expert being ops of their own); x: float32[N, hidden] -> float32[N, hidden].

    A softmax router picks top-k SwiGLU experts per token and mixes their outputs by the (optionally renormalized)
    router probabilities (edgeprobe_kernels.llama_ops.route, mix_experts: the agent's code). Each expert's GEMM sees
    only the rows routed to it, as on a device that loads just the chosen experts (EdgeMoE §3.3).
    """
    c = model.config
    logits = linear(f"blk.{i}.ffn_gate_inp", x)
    experts, weights = _router_hook(hooks, N.blk(i, N.ROUTER_HOOK), logits, c.n_experts_used, c.norm_topk)
    return mix_experts(x, experts, weights, lambda e, xr: swiglu(linear, f"blk.{i}.", f"_exps.{e}", xr))


@dataclass
class _Host:
    """What the host's op functions read in one forward call."""
    model: Model
    hooks: Hooks
    linear: LinearFn
    head: object


def _user(fn, *args):
    """A call into the caller's code (linear, head, hook): its error is raised as it was, not as an op failure."""
    try:
        return fn(*args)
    except HostRaised:
        raise
    except Exception as e:
        raise HostRaised(e) from None


def _seen(hooks: Hooks, attrs: dict, out: np.ndarray) -> np.ndarray:
    """An op's output through its hook: the hook point's (callable hooks see only those), or the op's name's."""
    point = attrs.get("hook")
    if callable(hooks):
        return _user(_hook, hooks, point, out) if point else out
    name = point if point in hooks else attrs["op"] if attrs["op"] in hooks else None
    return out if name is None else _user(_hook, hooks, name, out)


def _hooked(fn, at_points: bool = True):
    """fn with its output offered to the hooks; at_points False: by the op's name alone (moe_ffn, whose hook point,
    the router's logits, is inside it)."""
    def run(inp, attrs, ctx):
        out = fn(inp, attrs, ctx)
        hooks = ctx.host.hooks
        if hooks is None or (not at_points and (callable(hooks) or attrs["op"] not in hooks)):
            return out
        return _seen(hooks, attrs, out) if at_points else _user(_hook, hooks, attrs["op"], out)
    return run


def _op_linear(inp, attrs, ctx):
    return _user(ctx.host.linear, attrs["linear"], inp[0])


def _op_moe_ffn(inp, attrs, ctx):
    h = ctx.host
    return _user(moe_ffn, h.model, int(attrs["moe_layer"]), inp[0], h.hooks, h.linear)


def _op_lm_head(inp, attrs, ctx):
    """x float32[rows, hidden] -> logits float32[rows or batch, vocab] through the caller's head (a quantized model's
    Q8_0 head) or x @ output_weight^T."""
    x, B = inp[0], int(attrs.get("batch", 1))
    if attrs.get("last_only", True):
        x = np.ascontiguousarray(x.reshape(B, x.shape[0] // B, x.shape[1])[:, -1])
    head = ctx.host.head
    return softcap_logits(_user(head, x) if head else matmul_wt(x, ctx.host.model.output_weight), attrs)


# the agent's registry, with the host's linears, LM head and MoE router (its hook, the caller's linears), and every
# op's output offered to the hooks
_HOST_FNS = {"linear": _op_linear, "lm_head": _op_lm_head}
HOST_OPS = {**{kind: _hooked(fn) for kind, fn in {**OPS, **_HOST_FNS}.items()},
            "moe_ffn": _hooked(_op_moe_ffn, at_points=False)}
# without hooks: no wrapper per op (a decode step's ~450 ops each pay for one)
HOST_OPS_UNHOOKED = {**OPS, **_HOST_FNS, "moe_ffn": _op_moe_ffn}


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
    if logits not in ("all", "last", "none"):
        raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
    plan = float_plan(c, T, B, cache is not None, logits, HOST_OPS if hooks is not None else HOST_OPS_UNHOOKED)
    if cache is not None:
        cache.reserve(start + T)
    host = _Host(model, hooks, linear or float_linear(model), head or model.head)
    out = run_float(plan, model.weights.__getitem__, toks.reshape(-1), cache, host)
    if cache is not None:
        cache.length = start + T
    out = out.reshape(B, -1) if logits == "last" else out.reshape(B, T, -1)
    return out[0] if single else out


# ---- layer-major (issue 43, item 2): the float plan cut at layer boundaries, each window's live outputs kept between
# layers, so each layer's weights are read once a pass; the same ops on the same inputs, so the same bits


def _releaser(weights, plan, segments: list[list[str]]):
    """-> release(s), called once every window has run segment s: drops from `weights` the tensors this pass loaded
    that no later segment reads (layer i's blk.{i}.* after layer i; others after the last op naming them), so the
    pass holds one layer's weights at a time. Tensors held before the pass (a materialized model, a small model
    after an earlier pass) stay held; weights without LazyWeights.release (a plain dict) are left alone."""
    if not hasattr(weights, "release"):
        return lambda s: None
    held_before = weights.resident()
    layer_of_seg = [plan.ops[seg[0]].get("layer", -1) for seg in segments]
    last_read: dict[str, int] = {}
    for s, seg in enumerate(segments):
        for name in seg:
            for r in plan.ops[name].get("inputs", []):
                if "blob" in r:
                    last_read[r["blob"]] = s

    def done(name: str, s: int) -> bool:
        if name.startswith("blk."):  # host ops (linears, experts) read a layer's tensors inside its segment only
            return layer_of_seg[s] >= 0 and N.layer_of(name) <= layer_of_seg[s]
        return last_read.get(name, -1) <= s

    def release(s: int) -> None:
        weights.release([n for n in weights.resident() - held_before if done(n, s)])
    return release


def forward_layers(model: Model, chunks: list, done: Callable[[int, np.ndarray], None], hooks: Hooks = None,
                   linear: LinearFn | None = None, logits: str = "none", head=None, bar=None,
                   at_window: Callable[[int], object] | None = None) -> None:
    """forward(model, chunk, hooks=, linear=, logits=, head=) for every window of `chunks` (int[T] each, one T, each
    from an empty cache), run layer-major: every window through layer i, then layer i+1, so each layer's weights
    are read once (and released after it when `model.weights` is a LazyWeights). done(w, out) receives window w's
    output, the bits forward() returns, as soon as its last op ran, windows in order; its array is dropped then.
    Hooks fire layer by layer, every window in turn, at_window(w) called before window w's ops of each layer. `bar`
    (a tqdm or None) advances once per layer per window."""
    if logits not in ("all", "none"):
        raise ValueError(f"logits must be 'all' or 'none' layer-major, got {logits!r}")
    T = len(chunks[0])
    if any(len(c) != T for c in chunks):
        raise ValueError("layer-major windows must have one length")
    plan = float_plan(model.config, T, 1, False, logits, HOST_OPS if hooks is not None else HOST_OPS_UNHOOKED)
    (lane, names), = [(lane, names) for lane, names in plan.lane_order.items() if names]
    segments: list[list[str]] = []
    for name in names:  # program order is layer-major already (template: chunk, layer, stage)
        layer = plan.ops[name].get("layer", -1)
        if segments and plan.ops[segments[-1][-1]].get("layer", -1) == layer:
            segments[-1].append(name)
        else:
            segments.append([name])
    release = _releaser(model.weights, plan, segments)
    ctx = HostContext(get=model.weights.__getitem__, lane=lane,
                      host=_Host(model, hooks, linear or float_linear(model), head or model.head))
    tokens = [_as_batch(c, model.config.vocab_size)[0].reshape(-1) for c in chunks]
    results: list[dict] = [{} for _ in chunks]
    unread = [dict(plan.readers) for _ in chunks]
    out = plan.outputs[0]
    if bar is not None:
        bar.reset(total=len(segments) * len(chunks))
    with host_pass() as threads:
        for s, seg in enumerate(segments):
            for w in range(len(chunks)):
                threads.tick()
                if at_window is not None:
                    settle()  # the last window's statistics, before the profiles switch windows
                    at_window(w)
                run_float_part(plan, seg, tokens[w], ctx, results[w], unread[w])
                if s == len(segments) - 1:
                    settle()
                    done(w, results[w].pop(out).reshape(T, -1))
                    results[w].clear()
                if bar is not None:
                    bar.update(1)
            release(s)
