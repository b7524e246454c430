"""The `linear` op: a manifest record's runner on the run's lane (cpu and npu: linear_records' runners, kept in the
RunnerCache; npu on the hvx backend: Hexagon code; gpu: OpenCL), HeteroLLM's partitions of its int8 GEMM, and sibling
W8A8 linears that read one input computed in one kernel call (a fused decode step's q, k, v and gate, up).
"""
from __future__ import annotations

import numpy as np

from edgeprobe_kernels import int8_gemm
from edgeprobe_kernels.arena import ARENA
from edgeprobe_kernels.int8_gemm import GEMV_M
from edgeprobe_kernels.linear_records import (
    NPU_RUNNERS,
    RUNNERS,
    SHADOW_SCHEMES,
    W8A8_SCHEMES,
    run_shadow,
    run_w8a8,
    scheme_of,
    shadow_delta,
    w8a8_scale,
)

from .registry import OpError, _arr, op


def runner(ctx, rec, part, cols=None):
    """The cached runner of a linear record; built with counters=None: callers pass their run's counters."""
    scheme = scheme_of(rec)
    runners = NPU_RUNNERS if ctx.lane == "npu" else RUNNERS
    key = (part, cols, runners[scheme] if scheme in runners else None, ctx.runners.rec_key(rec))
    get = ctx.get
    if scheme in SHADOW_SCHEMES and ctx.map_blob is not None:  # cold shadow rows stay in flash: mapped, ~1% touched
        get = lambda sha: ctx.map_blob(sha) if sha == rec.get("cold") else ctx.get(sha)
    if part == "int8" or (scheme == "w8a8" and part == "all"):  # the emulated NPU keeps float32 copies
        build = lambda: run_w8a8(rec, get, None, cols, keep_f32=True, layout=_rows_layout(ctx))
    elif part == "all" and scheme in SHADOW_SCHEMES:  # a whole shadow linear (a pruned layer's is its int8 GEMM alone)
        build = lambda: run_shadow(rec, get, None, keep_f32=True, layout=_rows_layout(ctx))
    elif part == "shadow":
        build = lambda: shadow_delta(rec, get, None)
    elif scheme in runners:
        build = lambda: runners[scheme](rec, get, None)
    else:
        raise OpError("unknown_record", f"linear record scheme {scheme!r} is unknown to this agent")
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
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(i, int) for i in v)
            and 0 <= v[0] < v[1] <= size):
        raise OpError("bad_attrs", f"linear {key} must be [start, end) within 0..{size}, got {str(v)[:40]}")
    return tuple(v)


@op("linear")
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
        y = runner(ctx, rec, part, cols)(x, counters=ctx.counters)
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


def _gpu_linear(rec, part, x, ctx, cols=None):
    from edgeprobe_kernels.int8_gemm import quantize_per_tensor
    from edgeprobe_kernels.linear_records import q4_0_dequant
    from edgeprobe_kernels.opencl_gemm import shared
    from edgeprobe_kernels.tiles import dequantize_tiles_t

    g, scheme = shared(), scheme_of(rec)
    N, K = rec["shape"]
    if cols is not None and scheme not in W8A8_SCHEMES:
        raise OpError("bad_attrs", f"cols splits only int8 linears on the gpu lane, not {scheme!r}")
    if scheme == "float":
        return g.gemm_f32(x, ctx.get(rec["w"]), key=rec["w"])
    if scheme in W8A8_SCHEMES and part in ("all", "int8") and not (scheme in SHADOW_SCHEMES and part == "all"):
        sa = rec["scale_a"]
        wt = ctx.get(rec["wt"])  # int8[K, N]
        if cols is not None:
            wt = wt[:, cols[0]:cols[1]]
        c = g.gemm_s8s32(quantize_per_tensor(x, sa), wt.T, key=(rec["wt"], cols))
        return c.astype(np.float32) * w8a8_scale(rec, ctx.get, cols)
    if scheme in ("q4_0", "q4_0-tile"):  # W4A16: dequantize to FP16 once, half storage on the device
        key = rec["blocks"]
        if scheme == "q4_0":
            make = lambda: q4_0_dequant(ctx.get(key), N, rec["padded_k"])[:, :K]
        else:
            make = lambda: dequantize_tiles_t(ctx.get(key), N, K).T  # the npu lane's one-pass dequantizer
        w16 = ctx.runners.get(("f16", key), lambda: np.ascontiguousarray(make(), dtype=np.float16))
        return g.gemm_f16w(x.astype(np.float16).astype(np.float32), w16, key=key)
    raise OpError("no_gpu_kernel", f"linear record scheme {scheme!r} (part {part}) has no OpenCL kernel; "
                                   "put it on the cpu or npu lane")


def _group_weights(subs: list, ctx):
    """The stacked weights of sibling W8A8 linears (see group_linear), built once for all plans naming them."""
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


def group_linear(subs: list, x: np.ndarray, ctx) -> list | None:
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
        if scheme_of(rec) in SHADOW_SCHEMES and rec.get("shadow"):
            o = o + runner(ctx, rec, "shadow")(x, counters=ctx.counters)
        outs.append(o)
    return outs


def runs_beside(kind: str, attrs: dict) -> bool:
    """An op that runs beside another lane's long op without taking its cores (threads.Cores.enter): mllm-NPU's
    shadow delta (§3.3) on the CPU, a few percent of the work of the int8 GEMM it runs beside on the NPU."""
    return kind == "linear" and attrs.get("part") == "shadow"
