"""The op registry the executor runs: op kind -> fn(inputs, attrs, ctx) -> float32 array, plus its FLOPs.

Ops compute with `edgeprobe_kernels` (the same functions the host's forward pass and quantization
simulation use), so a plan run here matches the host. `ctx.get(sha)` reads a blob (resident or from
flash); `ctx.counters` collects kernel events (outliers, cold shadow rows read) of this run's lane alone:
cached runners are built without counters and get the calling run's at each call.
"""
from __future__ import annotations

import functools
import threading
from time import perf_counter_ns

import numpy as np

from edgeprobe_kernels.linear_records import (NPU_RUNNERS, RUNNERS, SHADOW_KINDS, W8A8_KINDS, run_shadow, run_w8a8,
                                              shadow_delta, w8a8_scale, x_wt)
from edgeprobe_kernels import int8_gemm
from edgeprobe_kernels.arena import ARENA
from edgeprobe_kernels.int8_gemm import GEMV_M
from edgeprobe_kernels.q8_0 import QK, matmul_q8_0
from edgeprobe_kernels.llama_ops import apply_rope, attention, geglu_act, head_rms_norm, rms_norm, rope_tables, swiglu_act

from .protocol import AgentError


class OpError(AgentError):
    """An op that cannot run on its inputs or attrs."""


def _arr(x, name: str, ndim: int | None = None) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise OpError("bad_input", f"{name} must be an array")
    if ndim is not None and x.ndim != ndim:
        raise OpError("bad_input", f"{name} must have {ndim} dimensions, got shape {x.shape}")
    return x


def op_embed(inp, attrs, ctx):
    """attrs start/length (optional): embed only that slice of the tokens (one chunk of a prompt)."""
    tokens, table = _arr(inp[0], "tokens", 1), _arr(inp[1], "table", 2)
    if "start" in attrs:
        tokens = tokens[int(attrs["start"]):int(attrs["start"]) + int(attrs["length"])]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= table.shape[0]):
        raise OpError("bad_input", f"token ids outside [0, {table.shape[0]})")
    x = np.asarray(table[tokens.astype(np.int64)], np.float32)
    return x * np.float32(attrs["scale"]) if "scale" in attrs else x  # Gemma scales by sqrt(hidden)


def op_rms_norm(inp, attrs, ctx):
    """attrs eps; head_dim: normalize each head's slice of x (Gemma 3's q/k norm) with w float32[head_dim]."""
    x, w = _arr(inp[0], "x", 2), _arr(inp[1], "w", 1)
    if "head_dim" in attrs:
        d = int(attrs["head_dim"])
        if d < 1 or x.shape[1] % d or w.shape[0] != d:
            raise OpError("bad_input", f"rms_norm per head of {d} needs x[rows, heads*{d}] and w[{d}], got {x.shape}, {w.shape}")
        return head_rms_norm(x, w, float(attrs["eps"]), d)
    return rms_norm(x, w, float(attrs["eps"]))


class RunnerCache:
    """Compiled linear runners (dequantized weights, float32 copies) kept across runs and shared by every
    run's lanes. One lock guards the dict; a runner is built outside it (builds read blobs), and when two
    lanes build the same one at once the first stored wins."""

    def __init__(self):
        self._fns: dict = {}
        self._keys: dict = {}  # id(rec) -> (rec, its key): the rec held, so its id is not reused while cached
        self._max_keys = 200_000  # each plan put brings new record objects: forget all past this (recomputed on use)
        self._lock = threading.Lock()

    def rec_key(self, rec: dict) -> tuple:
        """A manifest record's scalar fields as a hashable key, computed once per record object: a validated
        plan's records are never changed, and a decode step looks up ~200 of them."""
        with self._lock:
            hit = self._keys.get(id(rec))
        if hit is not None and hit[0] is rec:
            return hit[1]
        key = tuple(sorted((k, v) for k, v in rec.items() if isinstance(v, (str, int, float, bool))))
        self._remember(id(rec), rec, key)
        return key

    def per_object(self, obj, tag: str, make):
        """make(obj), computed once per (object, tag) and kept with the object (validated plans never change)."""
        with self._lock:
            hit = self._keys.get((id(obj), tag))
        if hit is not None and hit[0] is obj:
            return hit[1]
        val = make(obj)
        self._remember((id(obj), tag), obj, val)
        return val

    def _remember(self, key, obj, val) -> None:
        with self._lock:
            if len(self._keys) >= self._max_keys:
                self._keys.clear()
            self._keys[key] = (obj, val)

    def get(self, key, build):
        with self._lock:
            fn = self._fns.get(key)
        if fn is None:
            fn = build()
            with self._lock:
                fn = self._fns.setdefault(key, fn)
        return fn

    def __len__(self) -> int:
        with self._lock:
            return len(self._fns)


def _runner(ctx, rec, part, cols=None):
    """The cached runner of a linear record; built with counters=None: callers pass their run's counters."""
    kind = rec.get("kind")
    runners = NPU_RUNNERS if ctx.lane == "npu" else RUNNERS
    key = (part, cols, runners[kind] if kind in runners else None, ctx.runners.rec_key(rec))
    get = ctx.get
    if kind in SHADOW_KINDS and ctx.map_blob is not None:  # cold shadow rows stay in flash: mapped, ~1% touched
        get = lambda sha: ctx.map_blob(sha) if sha == rec.get("cold") else ctx.get(sha)
    if part == "int8" or (kind == "w8a8" and part == "all"):  # the emulated NPU keeps float32 copies
        build = lambda: run_w8a8(rec, get, None, cols, keep_f32=True, layout=_rows_layout(ctx))
    elif part == "all" and kind in SHADOW_KINDS:  # a whole shadow linear (a pruned layer's is its int8 GEMM alone)
        build = lambda: run_shadow(rec, get, None, keep_f32=True, layout=_rows_layout(ctx))
    elif part == "shadow":
        build = lambda: shadow_delta(rec, get, None)
    elif kind in runners:
        build = lambda: runners[kind](rec, get, None)
    else:
        raise OpError("unknown_record", f"linear record kind {kind!r} is unknown to this agent")
    return ctx.runners.get(key, build)


def _rows_layout(ctx):
    """sha -> the row-major int8[N, K] copy of a W8A8 weight whose blob is k-major int8[K, N], kept in the store's
    flash (FlashStore.layout: read from there, else transposed from the mapped blob, which is never kept resident);
    None where the run has no store (a host running plans in-process). into: fill this array instead of a new one."""
    if ctx.layout is None or ctx.map_blob is None or ctx.blob_meta is None:
        return None

    def rows(sha, into=None):
        # the blob's shape from the store's index: mapped only to make the layout (210 maps, ~10 ms of a first run)
        m = ctx.blob_meta(sha)
        dtype, shape = m["dtype"], m["shape"]
        if len(shape) != 2 or np.dtype(dtype) != np.int8:
            raise OpError("bad_input", f"a W8A8 weight is int8[K, N], blob {str(sha)[:12]} is {dtype}{list(shape)}")
        return ctx.layout(sha, "rows", tuple(shape[::-1]), np.int8,
                          lambda out: int8_gemm.transpose_into(ctx.map_blob(sha), out), empty=ARENA.empty, into=into)
    return rows


def _span(attrs, key, size):
    v = attrs.get(key)
    if v is None:
        return None
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(i, int) for i in v) and 0 <= v[0] < v[1] <= size):
        raise OpError("bad_attrs", f"linear {key} must be [start, end) within 0..{size}, got {str(v)[:40]}")
    return tuple(v)


def op_linear(inp, attrs, ctx):
    """attrs: rec (a manifest record), part: "all" | "int8" (the int8 GEMM of w8a8-shadow) | "shadow".
    HeteroLLM partitions (§4.1), int8 part only: rows [a, b) of x (sequence cut), cols [a, b) of the output
    (row cut), pad_to L (a pre-built NPU graph of L rows: x zero-padded to L, padding computed, then dropped).
    On the gpu lane the GEMM runs as an OpenCL kernel (kernels/opencl_gemm.py)."""
    x = _arr(inp[0], "x", 2)
    rec, part = attrs["rec"], attrs.get("part", "all")
    rows, cols = _span(attrs, "rows", x.shape[0]), _span(attrs, "cols", int(rec["shape"][0]))
    pad = attrs.get("pad_to")
    if (rows or cols or pad) and part != "int8":
        raise OpError("bad_attrs", "rows / cols / pad_to split only the int8 GEMM of a linear (part int8)")
    if rows:
        x = x[rows[0]:rows[1]]
    m = x.shape[0]
    if pad is not None:
        if not isinstance(pad, int) or pad < m:
            raise OpError("bad_attrs", f"pad_to must be an int >= the {m} rows it pads, got {str(pad)[:20]}")
        x = np.concatenate([x, np.zeros((pad - m, x.shape[1]), x.dtype)])
    if ctx.lane == "gpu":
        y = _gpu_linear(rec, part, x, ctx, cols)
    elif ctx.lane == "npu" and ctx.backends.get("npu") == "hvx" and (fn := _hvx_runner(ctx, rec, part, cols)):
        y = _hvx_call(fn, x, ctx)
    else:
        y = _runner(ctx, rec, part, cols)(x, counters=ctx.counters)
    return y[:m] if pad is not None else y


def _hvx_runner(ctx, rec, part, cols):
    """The record's runner on the Hexagon DSP (kernels/hvx_linear.py), or False when it is not NPU work."""
    from edgeprobe_kernels import hvx_linear

    key = ("hvx", part, cols, ctx.runners.rec_key(rec))
    return ctx.runners.get(key, lambda: hvx_linear.runner(rec, part, ctx.get, cols) or False)


def _hvx_call(fn, x, ctx):
    """One linear on the DSP: its QEMU counts go into the op's trace event (with a v73 cycle estimate) and the
    run's counters."""
    from edgeprobe_kernels.hvx_bridge import ISA, dsp_estimate

    c = {}
    y = fn(x, counters=ctx.counters, dsp_counts=c)
    if ctx.event is not None:
        ctx.event.update({"emulated": "isa", "isa": ISA, "backend": "hvx", **dsp_estimate(c)})
    for name, k in (("hvx_packets", "packets"), ("hvx_insns", "hvx_insns")):
        ctx.counters[name] = ctx.counters.get(name, 0) + int(c.get(k, 0))
    return y


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


def _gpu_linear(rec, part, x, ctx, cols=None):
    from edgeprobe_kernels.int8_gemm import quantize_per_tensor
    from edgeprobe_kernels.linear_records import q4_0_dequant
    from edgeprobe_kernels.opencl_gemm import shared
    from edgeprobe_kernels.tiles import dequantize_tiles_t

    g, kind = shared(), rec.get("kind")
    N, K = rec["shape"]
    if cols is not None and kind not in W8A8_KINDS:
        raise OpError("bad_attrs", f"cols splits only int8 linears on the gpu lane, not {kind!r}")
    if kind == "float":
        return g.gemm_f32(x, ctx.get(rec["w"]), key=rec["w"])
    if kind in W8A8_KINDS and part in ("all", "int8") and not (kind in SHADOW_KINDS and part == "all"):
        sa = rec["scale_a"]
        wt = ctx.get(rec["wt"])  # int8[K, N]
        if cols is not None:
            wt = wt[:, cols[0]:cols[1]]
        c = g.gemm_s8s32(quantize_per_tensor(x, sa), wt.T, key=(rec["wt"], cols))
        return c.astype(np.float32) * w8a8_scale(rec, ctx.get, cols)
    if kind in ("q4_0", "q4_0-tile"):  # W4A16: dequantize to FP16 once, half storage on the device
        key = rec["blocks"]
        if kind == "q4_0":
            make = lambda: q4_0_dequant(ctx.get(key), N, rec["padded_k"])[:, :K]
        else:
            make = lambda: dequantize_tiles_t(ctx.get(key), N, K).T  # the npu lane's one-pass dequantizer
        w16 = ctx.runners.get(("f16", key), lambda: np.ascontiguousarray(make(), dtype=np.float16))
        return g.gemm_f16w(x.astype(np.float16).astype(np.float32), w16, key=key)
    raise OpError("no_gpu_kernel", f"linear record kind {kind!r} (part {part}) has no OpenCL kernel; "
                                   "put it on the cpu or npu lane")


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


def op_attention(inp, attrs, ctx):
    """inputs q, k, v — or, for chunk i of a chunked prefill, q, k_0..k_i, v_0..v_i (attrs parts = i + 1):
    the chunk's queries attend to the keys of every chunk so far (mllm-NPU eq. 2), causally from `start`.
    attrs session + layer (+ batch B): k, v of the new positions go into the run's KV session, and the queries
    attend over everything the session holds (attrs kv_layer: which layer of it) (prefill then decode steps on the agent)."""
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
    return attention(q.reshape(B, T, H, d), kk, vv, start, int(attrs.get("window", 0))).reshape(B * T, H * d)


def op_add(inp, attrs, ctx):
    out = _arr(inp[0], "a").copy()
    for b in inp[1:]:
        out += _arr(b, "b")
    return out


def op_swiglu(inp, attrs, ctx):
    return swiglu_act(_arr(inp[0], "gate", 2), _arr(inp[1], "up", 2))


def op_geglu(inp, attrs, ctx):
    return geglu_act(_arr(inp[0], "gate", 2), _arr(inp[1], "up", 2))


def op_sigmoid_mul(inp, attrs, ctx):
    """x float32[rows, n] * sigmoid(g float32[rows, 1]): Qwen-MoE's gate on its shared expert."""
    x, g = _arr(inp[0], "x", 2), _arr(inp[1], "g", 2)
    if g.shape != (x.shape[0], 1):
        raise OpError("bad_input", f"sigmoid_mul gates rows of x {x.shape} by g[rows, 1], got g {g.shape}")
    return x * (1.0 / (1.0 + np.exp(-g)))


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
        return matmul_q8_0(x, w, d)
    return x_wt(x, w)


def flops(kind: str, inp, out, attrs, ctx=None) -> int:
    """Multiply-adds x2 of the op (0 for data movement; a fused op reports its sub-ops' sum itself)."""
    if kind == "fused":
        return 0
    if kind == "linear" and attrs.get("part") != "shadow":
        rows = attrs.get("rows")
        m = attrs.get("pad_to") or (rows[1] - rows[0] if rows else inp[0].shape[0])  # padded rows are computed too
        return 2 * m * inp[0].shape[1] * out.shape[1]
    if kind == "lm_head":
        return 2 * out.shape[0] * inp[0].shape[1] * out.shape[1]
    if kind == "ffn_flash":  # predictor + the active neurons' three products (counted from the output rows)
        return 2 * inp[0].shape[0] * inp[1].shape[1] * (inp[0].shape[1] + inp[2].shape[1])
    if kind == "attention":
        T, H, d = inp[0].shape[0], int(attrs["n_heads"]), int(attrs["head_dim"])
        S = sum(a.shape[0] for a in inp[1:1 + int(attrs.get("parts", 1))])
        if attrs.get("session") and ctx is not None and ctx.session is not None:  # all the session's keys
            return 4 * H * T * (S // int(attrs.get("batch", 1)) + ctx.session.length + ctx.offset) * d
        return 4 * H * T * S * d  # QK^T and PV over S keys (the causal mask still computes them)
    return int(out.size)


def _sibling_groups(subs: list) -> list:
    """A fused op's sub-ops as steps: a sub-op alone, or a list of consecutive W8A8 linears that read the same
    input (q, k, v; gate, up), which a decode step computes in one call (_group_linear)."""
    steps, i = [], 0
    while i < len(subs):
        j = i + 1
        if _groupable(subs[i]):
            K = subs[i]["attrs"]["rec"]["shape"][1]
            while j < len(subs) and _groupable(subs[j]) and subs[j]["inputs"] == subs[i]["inputs"] \
                    and subs[j]["attrs"]["rec"]["shape"][1] == K:
                j += 1
        steps.append(subs[i:j] if j - i > 1 else subs[i])
        i = j
    return steps


def _groupable(sub: dict) -> bool:
    a = sub.get("attrs", {})
    rec = a.get("rec")
    return sub["kind"] == "linear" and isinstance(rec, dict) and rec.get("kind") in W8A8_KINDS \
        and a.get("part", "all") == "all" and not any(k in a for k in ("rows", "cols", "pad_to")) \
        and isinstance(rec.get("shape"), list) and len(rec["shape"]) == 2 and len(sub.get("inputs", [])) == 1


def _group_weights(subs: list, ctx):
    """The stacked weights of sibling W8A8 linears (see _group_linear), built once for all plans naming them."""
    recs = [s["attrs"]["rec"] for s in subs]

    def build():
        rows = _rows_layout(ctx)
        wts = [(ctx.map_blob if rows else ctx.get)(rec["wt"]) for rec in recs]  # int8[K, N] each
        bounds = np.cumsum([0] + [wt.shape[1] for wt in wts])
        w = ARENA.empty((int(bounds[-1]), wts[0].shape[0]), np.int8)  # their rows stacked, row-major
        for p, (rec, wt) in enumerate(zip(recs, wts)):
            if rows:
                rows(rec["wt"], into=w[bounds[p]:bounds[p + 1]])
            else:
                int8_gemm.transpose_into(wt, w[bounds[p]:bounds[p + 1]])
        scales = [np.broadcast_to(w8a8_scale(rec, ctx.get), wt.shape[1]) for rec, wt in zip(recs, wts)]
        parts = [np.full(wt.shape[1], p, np.int32) for p, wt in enumerate(wts)]
        sa = np.array([r["scale_a"] for r in recs], np.float32)
        return sa, np.concatenate(parts), w, np.concatenate(scales).astype(np.float32), bounds
    return ctx.runners.get(("w8a8-group",) + tuple(ctx.runners.rec_key(r) for r in recs), build)


def _group_linear(subs: list, x: np.ndarray, ctx) -> list | None:
    """The outputs of sibling W8A8 linears on x, from one kernel call (their int8 GEMVs; shadow deltas added per
    linear as run_shadow does: the same bits), or None where the linears run one by one: prefill rows, no numba,
    the gpu lane, the hvx backend."""
    if not (int8_gemm.numba is not None and x.ndim == 2 and x.shape[0] <= GEMV_M and ctx.lane != "gpu"
            and not (ctx.lane == "npu" and ctx.backends.get("npu") == "hvx")):
        return None
    recs = [s["attrs"]["rec"] for s in subs]
    if any(x.shape[1] != int(r["shape"][1]) for r in recs):
        return None  # a shape mismatch: the single path reports it
    # the step list is the fused op's own (kept with its attrs): its weights are looked up once, not per step
    sa, part, w, scale, bounds = ctx.runners.per_object(subs, "w8a8-group", lambda s: _group_weights(s, ctx))
    y = int8_gemm.linear_w8a8_gemv_group(x, sa, part, w, scale)
    outs = []
    for p, rec in enumerate(recs):
        o = y[:, bounds[p]:bounds[p + 1]]
        o = o.copy() if x.shape[0] > 1 else o  # one row: a contiguous view
        if rec["kind"] in SHADOW_KINDS and rec.get("shadow"):
            o = o + _runner(ctx, rec, "shadow")(x, counters=ctx.counters)
        outs.append(o)
    return outs


def _plain_linear(sub: dict) -> bool:
    """A sub-op that is a whole linear with no split (a decode step's o and down projections): op_fused calls its
    cached runner directly, without op_linear's per-call lookups."""
    a = sub.get("attrs", {})
    return sub["kind"] == "linear" and isinstance(a.get("rec"), dict) and a.get("part", "all") == "all" \
        and not any(k in a for k in ("rows", "cols", "pad_to")) and len(sub.get("inputs", [])) == 1


def _compile_fused(attrs: dict) -> tuple[list, bool]:
    """attrs ops as steps: (a list of sibling linears or None, [(sub-op, its input refs as ("arg", i) | ("op", name),
    whether it is a plain linear)]), and whether the op is a step op (has fused sub-ops: each sub-op its own event)."""
    steps = []
    step_op = any(s["kind"] == "fused" for s in attrs["ops"])
    for step in ([s] for s in attrs["ops"]) if step_op else _sibling_groups(attrs["ops"]):
        subs = step if isinstance(step, list) else [step]
        steps.append((step if isinstance(step, list) and not step_op else None,
                      [(sub, [("arg", r["arg"]) if "arg" in r else ("op", r["op"]) for r in sub["inputs"]], _plain_linear(sub))
                       for sub in subs]))
    return steps, step_op


def op_fused(inp, attrs, ctx):
    """A run of one lane's consecutive ops computed back to back as one op (a decode step's layer: its ~15 ops
    cost more in hand-offs than in arithmetic). attrs ops: [{"name", "kind", "inputs": [{"arg": i} (the fused
    op's input i) | {"op": an earlier sub-op}], "attrs"}]; the value is the last sub-op's. The op's trace event
    gets the summed flops, and parts_us: each sub-op kind's time inside it. The sub-ops are parsed once per
    plan (validated plans never change) and a plain linear's runner is looked up once per lane: a decode step
    runs ~400 sub-ops, and their Python around the kernels ran from caches the weights had just swept.
    A fused op with fused sub-ops (one level; "layer" and "deps" on each sub-op for its event) is a step op: a
    whole decode step, embedding, layers, final norm and head, in one op. Each of its sub-ops keeps its own trace
    event, timed here (ctx.event["sub_events"], which the executor emits in place of this op's), and the step
    pays one dispatch between ops instead of one per layer and one each for the ops around them."""
    local, parts, total = {}, {}, 0
    nested = []
    hvx = ctx.lane == "npu" and ctx.backends.get("npu") == "hvx"
    runners = ctx.runners
    steps, step_op = runners.per_object(attrs, "steps", _compile_fused)
    t = perf_counter_ns()
    for group, subs in steps:
        if group is not None:
            src, i = subs[0][1][0]
            x = inp[i] if src == "arg" else local[i]
            outs = _group_linear(group, x, ctx)
            if outs is not None:
                for sub, out in zip(group, outs):
                    local[sub["name"]] = out
                    total += 2 * x.shape[0] * x.shape[1] * out.shape[1]
                t1 = perf_counter_ns()
                parts["linear"] = parts.get("linear", 0.0) + (t1 - t) / 1000.0
                t = t1
                continue
        for sub, rr, plain in subs:
            args = [inp[i] if src == "arg" else local[i] for src, i in rr]
            kind, a = sub["kind"], sub.get("attrs", {})
            if step_op:
                out = _own_event(sub, args, ctx, nested, plain and not hvx)
                total += nested[-1].get("flops", 0)
            else:
                out = _sub_value(sub, args, ctx, plain and not hvx)
                # a plain linear's flops without flops()'s lookups (60 of them a decode step)
                total += 2 * args[0].shape[0] * args[0].shape[1] * out.shape[1] if plain else flops(kind, args, out, a, ctx)
            local[sub["name"]] = out
            t1 = perf_counter_ns()
            parts[kind] = parts.get(kind, 0.0) + (t1 - t) / 1000.0
            t = t1
    if ctx.event is not None:
        ctx.event.update({"flops": int(total), "parts_us": parts, "fused_ops": len(attrs["ops"])})
        if nested:
            ctx.event["sub_events"] = nested
    return out


def _sub_value(sub: dict, args: list, ctx, plain: bool):
    """A fused op's sub-op computed: a plain linear (plain: not on the hvx backend) through its runner, looked up once
    per lane, except on the gpu lane (op_linear picks its OpenCL kernel); any other sub-op through its op."""
    if plain and ctx.lane != "gpu" and isinstance(args[0], np.ndarray) and args[0].ndim == 2:
        fn = ctx.runners.per_object(sub, ctx.lane, lambda s: _runner(ctx, s["attrs"]["rec"], "all"))
        return fn(args[0], counters=ctx.counters)
    return OPS[sub["kind"]](args, sub.get("attrs", {}), ctx)


def _own_event(sub: dict, args: list, ctx, events: list, plain: bool):
    """A sub-op of a step op (a fused layer, or an op around the layers: embed, final norm, head), run and timed,
    its trace event appended to events with the fields the executor gives a dispatched op."""
    outer, ctx.event = ctx.event, {}
    kind, a = sub["kind"], sub.get("attrs", {})
    t0 = perf_counter_ns()
    try:
        out = op_fused(args, a, ctx) if kind == "fused" else _sub_value(sub, args, ctx, plain)
    finally:
        t1 = perf_counter_ns()
        own, ctx.event = ctx.event, outer
    ev = {**(ctx.sub_event or {}), "name": sub["name"], "kind": kind, "layer": sub.get("layer", -1),
          "deps": sub.get("deps", []), "group": sub["name"], "start_us": t0 / 1000.0, "end_us": t1 / 1000.0,
          "bytes_in": bytes_in(args), "bytes_out": out.nbytes, "shape": list(out.shape)}
    if kind != "fused":
        ev["flops"] = int(flops(kind, args, out, a, ctx))
    ev.update(own)  # the op's own fields win, as the executor merges them
    events.append(ev)
    return out


def bytes_in(args: list) -> int:
    """The bytes of an op's array inputs (its trace event's bytes_in)."""
    n = 0
    for a in args:
        if isinstance(a, np.ndarray):
            n += a.nbytes
    return n


def check_fused(name: str, attrs: dict, n_inputs: int, nested: bool = False) -> None:
    """Refuse a malformed fused op before the plan runs (called by the executor's validate). Its sub-ops may be
    fused ops themselves, one level deep (a step op, op_fused)."""
    subs = attrs.get("ops")
    if not isinstance(subs, list) or not subs:
        raise OpError("bad_attrs", f"fused op {name!r} needs a non-empty list attrs.ops")
    seen = set()
    step_op = any(isinstance(sub, dict) and sub.get("kind") == "fused" for sub in subs)
    for i, sub in enumerate(subs):
        if not isinstance(sub, dict) or not isinstance(sub.get("name"), str) or sub.get("kind") not in OPS \
                or (sub["kind"] == "fused" and nested) or not isinstance(sub.get("inputs", []), list) \
                or not isinstance(sub.get("attrs", {}), dict):
            raise OpError("bad_attrs", f"fused op {name!r}: sub-op #{i} needs a name, a kind this agent runs (a "
                                       "fused op only one level deep), a list of inputs and a map of attrs")
        for r in sub.get("inputs", []):
            ok = isinstance(r, dict) and len(r) == 1 and (
                ("arg" in r and isinstance(r["arg"], int) and 0 <= r["arg"] < n_inputs) or r.get("op") in seen)
            if not ok:
                raise OpError("bad_attrs", f"fused op {name!r}: sub-op {sub['name']!r} input {str(r)[:40]} must be "
                                           f"{{'arg': i < {n_inputs}}} or {{'op': an earlier sub-op}}")
        if step_op and (not isinstance(sub.get("layer", -1), int) or isinstance(sub.get("layer", -1), bool)
                        or not isinstance(sub.get("deps", []), list)
                        or not all(isinstance(d, str) for d in sub.get("deps", []))):
            raise OpError("bad_attrs", f"fused op {name!r}: sub-op {sub['name']!r} of a step op (one with fused "
                                       "sub-ops, each sub-op its own event) has an int layer and a list of names as "
                                       "deps, if any")
        if sub["kind"] == "fused":
            check_fused(f"{name}/{sub['name']}", sub.get("attrs", {}), len(sub.get("inputs", [])), nested=True)
        seen.add(sub["name"])


def _ffn_flash(inp, attrs, ctx):
    from .neurons import op_ffn_flash  # imports ops (for OpError): loaded on first use

    return op_ffn_flash(inp, attrs, ctx)


def _moe_ffn(inp, attrs, ctx):
    from .experts import op_moe_ffn

    return op_moe_ffn(inp, attrs, ctx)


def runs_beside(kind: str, attrs: dict) -> bool:
    """An op that runs beside another lane's long op without taking its cores (threads.Cores.enter): mllm-NPU's
    shadow delta (§3.3) on the CPU, a few percent of the work of the int8 GEMM it runs beside on the NPU."""
    return kind == "linear" and attrs.get("part") == "shadow"


# op kind -> the input it gathers a few rows from: a blob there is mapped, not read whole (an embedding table is
# 113 MB float32 for SmolLM2, as large as the rest of the int8 model; a run reads only its tokens' rows' pages)
GATHERS_ROWS = {"embed": 1}

OPS = {"ffn_flash": _ffn_flash, "moe_ffn": _moe_ffn, "embed": op_embed, "rms_norm": op_rms_norm, "linear": op_linear, "rope": op_rope, "attention": op_attention,
       "add": op_add, "swiglu": op_swiglu, "lm_head": op_lm_head, "concat": op_concat, "sigmoid_mul": op_sigmoid_mul,
       "geglu": op_geglu, "fused": op_fused}
