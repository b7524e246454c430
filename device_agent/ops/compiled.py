"""Fused decode layers run compiled (edgeprobe_kernels.decode_layer): a Llama-style W8A8 layer's 15 sub-ops,
recognized once per plan (match) and run for one decode row (run), bit for bit what op_fused computes sub-op by
sub-op; a step op's chained layers of that kind as one call (layer_runs, run_layers), each with its own event.
q4_0-tile layers on the npu lane (the NPU TTS paper's decode) run the same way, chained runs only, with the npu
lane's GEMV from codes (f16_gemm.gemv_q4_seq's bits).
Anything else, and any run the compiled call cannot take as it comes (a numerics capture, rows other than one, a KV
session that would refuse the write), goes the sub-op path, which also gives the errors.
EDGEPROBE_COMPILED_LAYERS=0 turns it off (A/B runs: bench/decode_overhead.py).
"""
from __future__ import annotations

import os
from time import perf_counter_ns

import numpy as np

from edgeprobe_kernels import decode_layer
from edgeprobe_kernels.decode_layer import typed_list as typed
from edgeprobe_kernels.f16_gemm import q4_rows_exact
from edgeprobe_kernels.linear_records import scheme_of
from edgeprobe_kernels.llama_ops import _scale64
from edgeprobe_kernels.tiles import padded, tiles_q4_rows

from .dense import _rope_tables
from .linear import _group_weights

ENABLED = os.environ.get("EDGEPROBE_COMPILED_LAYERS", "1") != "0"
# the linears' schemes a compiled layer computes, each with its kernel (None where this CPU or Python lacks it)
SCHEMES = {"w8a8": decode_layer.layers_w8a8, "q4_0-tile": decode_layer.layers_q4}

# the layer's sub-ops: kind, inputs as ("arg", which of the layer's args: x, norm 1, norm 2) or ("op", sub-op index)
PATTERN = (
    ("rms_norm", (("arg", "x"), ("arg", "n1"))),
    ("linear", (("op", 0),)), ("linear", (("op", 0),)), ("linear", (("op", 0),)),
    ("rope", (("op", 1),)), ("rope", (("op", 2),)),
    ("attention", (("op", 4), ("op", 5), ("op", 3))),
    ("linear", (("op", 6),)),
    ("add", (("arg", "x"), ("op", 7))),
    ("rms_norm", (("op", 8), ("arg", "n2"))),
    ("linear", (("op", 9),)), ("linear", (("op", 9),)),
    ("swiglu", (("op", 10), ("op", 11))),
    ("linear", (("op", 12),)),
    ("add", (("op", 8), ("op", 13))),
)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def match(attrs: dict) -> dict | None:
    """The compiled layer's constants if attrs' sub-ops are PATTERN with one-row linears of one scheme of SCHEMES
    (W8A8 with no shadow GEMM: w8a8; q4_0-tile), plain RMSNorms and RoPE, and attention over a batch-1 KV session;
    else None."""
    subs = attrs.get("ops")
    if not decode_layer.layer_w8a8 or not isinstance(subs, list) or len(subs) != len(PATTERN):
        return None
    names = [s.get("name") for s in subs]
    args: dict = {}
    for sub, (kind, refs) in zip(subs, PATTERN):
        ins = sub.get("inputs")
        if sub.get("kind") != kind or not isinstance(ins, list) or len(ins) != len(refs):
            return None
        for r, (src, want) in zip(ins, refs):
            if src == "op" and r != {"op": names[want]}:
                return None
            if src == "arg" and (not isinstance(r, dict) or list(r) != ["arg"] or args.setdefault(want, r["arg"])
                                 != r["arg"]):
                return None
    a = [s.get("attrs", {}) for s in subs]
    lin = [i for i, (k, _) in enumerate(PATTERN) if k == "linear"]
    scheme = scheme_of(a[1]["rec"]) if isinstance(a[1].get("rec"), dict) else None
    if SCHEMES.get(scheme) is None:
        return None
    for i in lin:
        rec = a[i].get("rec")
        if not isinstance(rec, dict) or scheme_of(rec) != scheme or a[i].get("part", "all") != "all" \
                or any(k in a[i] for k in ("rows", "cols", "pad_to")) or not isinstance(rec.get("shape"), list) \
                or len(rec["shape"]) != 2 or not all(_int(v) and v > 0 for v in rec["shape"]):
            return None
    rq, rk, at = a[4], a[5], a[6]
    H, KV, d = at.get("n_heads"), at.get("n_kv_heads"), at.get("head_dim")
    if not all(_int(v) and v > 0 for v in (H, KV, d)) or H % KV or d % 2:
        return None
    for r, heads in ((rq, H), (rk, KV)):
        if r.get("heads") != heads or r.get("head_dim") != d or r.get("batch", 1) != 1 or r.get("session") is not True \
                or r.get("freq_factors") or r.get("theta") != rq.get("theta") \
                or not isinstance(r.get("theta"), (int, float)) or isinstance(r.get("theta"), bool):
            return None
    if at.get("session") is not True or at.get("batch", 1) != 1 or at.get("parts", 1) != 1 \
            or not _int(at.get("kv_layer")) or not _int(at.get("window", 0)) or at.get("window", 0) < 0 \
            or not all(isinstance(at.get(k, 0.0), (int, float)) for k in ("scale", "softcap")):
        return None
    if any("head_dim" in a[i] or not isinstance(a[i].get("eps"), (int, float)) for i in (0, 9)):
        return None
    D = a[1]["rec"]["shape"][1]
    F = a[10]["rec"]["shape"][0]
    want = {1: [H * d, D], 2: [KV * d, D], 3: [KV * d, D], 7: [D, H * d], 10: [F, D], 11: [F, D], 13: [D, F]}
    if any(a[i]["rec"]["shape"] != s for i, s in want.items()):
        return None
    groups = ([subs[1], subs[2], subs[3]], [subs[7]], [subs[10], subs[11]], [subs[13]])
    flops = 2 * D * ((H + 2 * KV) * d + H * d + 3 * F) + 2 * D + (H + KV) * d + 2 * D + F
    # q4_0-tile siblings side by side: each one's columns padded to whole tiles (where k, v and up start)
    return {"args": args, "H": H, "KV": KV, "d": d, "D": D, "F": F, "scheme": scheme, "groups": groups,
            "ko": padded(H * d), "vo": padded(H * d) + padded(KV * d), "uo": padded(F), "layer": at["kv_layer"],
            "theta": float(rq["theta"]), "window": at.get("window", 0),
            "scale64": _scale64(d, float(at.get("scale", 0.0))),
            "softcap": float(at.get("softcap", 0.0)), "eps": (np.float32(a[0]["eps"]), np.float32(a[9]["eps"])),
            "flops": flops}


def _vec(v, D: int) -> bool:
    return isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == (D,) and v.flags.c_contiguous


def _q4_weights(groups, ctx):
    """The four q4_0-tile GEMVs' (codes, d16) in tiles_q4_rows' layout, siblings side by side, built once for all
    plans naming them, or None where a blob's shape is not the one its record names or a scale is past
    f16_gemm.D_MAX (the sub-op path takes the float32 weight there)."""
    recs = [[s["attrs"]["rec"] for s in g] for g in groups]

    def build():
        out = []
        for rs in recs:
            try:  # a record or blob the sub-op path refuses with its own error
                cds = [tiles_q4_rows(ctx.get(r["blocks"]), *map(int, r["shape"])) for r in rs]
            except (KeyError, TypeError, ValueError):
                return False
            codes, d16 = (np.concatenate([cd[i] for cd in cds], axis=1) for i in (0, 1))
            if any(c.shape[0] != codes.shape[0] for c, _ in cds) or not q4_rows_exact(d16):
                return False
            out.append((codes, d16))
        return tuple(out)
    return ctx.runners.get(("q4-layer",) + tuple(ctx.runners.rec_key(r) for rs in recs for r in rs), build) or None


def _weights(m: dict, groups, ctx):
    """The four GEMVs' (sa, part, w, scale), stacked once as group_linear stacks them (the q/k/v and gate/up stacks
    are the same arrays), or None where a blob's shape is not the one its record names; q4_0-tile: _q4_weights."""
    if m["scheme"] == "q4_0-tile":
        return _q4_weights(groups, ctx)
    D, H, KV, d = m["D"], m["H"], m["KV"], m["d"]
    F = groups[2][0]["attrs"]["rec"]["shape"][0]
    ws = tuple(_group_weights(g, ctx)[:4] for g in groups)
    for (sa, part, w, scale), g, rows, k in zip(ws, groups, ((H + 2 * KV) * d, D, 2 * F, D), (D, H * d, D, F)):
        if w.shape != (rows, k) or part.shape != (rows,) or scale.shape != (rows,) or sa.shape != (len(g),):
            return None
    return ws


def run(m: dict, inp: list, ctx) -> np.ndarray | None:
    """The layer's output float32[1, D] for the one row inp[x] (its event gets flops, parts_us split by the parts'
    cycles, fused_ops and compiled_layer), or None where the sub-op path must run it."""
    if m["scheme"] != "w8a8":  # a q4_0-tile layer compiles in runs of two or more (run_layers) only
        return None
    D, H, KV, d = m["D"], m["H"], m["KV"], m["d"]
    args = m["args"]
    x, n1, n2 = inp[args["x"]], inp[args["n1"]], inp[args["n2"]]
    sess = ctx.session
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.shape == (1, D) and sess is not None
            and sess.batch == 1 and 0 <= m["layer"] < sess.n_layers):
        return None
    norms = m.get("norms")  # the norms' weights are the same blobs every step: checked once
    if norms is None or norms[0] is not n1 or norms[1] is not n2:
        if not (_vec(n1, D) and _vec(n2, D)):
            return None
        m["norms"] = (n1, n2)
    pos = sess.length + ctx.offset
    kc, vc = sess.k[m["layer"]], sess.v[m["layer"]]
    if not (0 <= pos < sess.capacity and kc.shape == vc.shape == (1, KV, sess.capacity, d) and kc.dtype == np.float32
            and vc.dtype == np.float32 and kc.flags.c_contiguous and vc.flags.c_contiguous):
        return None
    ws = m.get("weights")  # m is kept per plan by the run's runner cache, whose weights these are
    if ws is None:
        ws = m["weights"] = _weights(m, m["groups"], ctx) or False
    if not ws:
        return None
    cos, sin = _rope_tables(d, m["theta"], pos, 1, None)
    ticks = np.zeros(len(decode_layer.PARTS), np.int64)
    (sa3, p3, w3, s3), (sao, po, wo, so), (sa2, p2, w2, s2), (sad, pd, wd, sd) = ws
    t0 = perf_counter_ns()
    out, exp_ns = decode_layer.layer_w8a8(np.ascontiguousarray(x), n1, m["eps"][0], w3, sa3, p3, s3, H, KV, cos, sin,
                                          kc, vc, pos, m["window"], m["scale64"], m["softcap"], wo, sao, po, so, n2,
                                          m["eps"][1], w2, sa2, p2, s2, wd, sad, pd, sd, ticks)
    us = (perf_counter_ns() - t0) / 1000.0
    if ctx.event is not None:  # the compiled parts' share of the time outside numpy's exp, by their cycles
        tl = ticks.tolist()
        f = max(us - exp_ns / 1000.0, 0.0) / (sum(tl) or 1)
        parts = dict(zip(decode_layer.PARTS, [t * f for t in tl]))
        parts["swiglu"] += exp_ns / 1000.0
        ctx.event.update({"flops": m["flops"] + 4 * H * (1 + pos) * d, "fused_ops": len(PATTERN),
                          "parts_us": parts, "compiled_layer": True})
    return out


SHARED = ("H", "KV", "d", "D", "F", "scheme", "theta", "window", "scale64", "softcap")  # one call's layers agree


def layer_runs(subs: list) -> dict:
    """A step op's runs of two or more consecutive compiled layers, each reading the last one's output as its x and
    its norms from the step's args, and no later sub-op reading a layer's output but the run's last:
    {index of the run's first sub-op: {"end": the index past its last, "ms": their match()es, "subs": the sub-ops}}."""
    ms = [match(s.get("attrs", {})) if s.get("kind") == "fused" else None for s in subs]
    runs, i = {}, 0
    while i < len(subs):
        j = i + 1
        if ms[i] is not None:
            while j < len(subs) and ms[j] is not None and _chained(subs[j - 1], subs[j], ms[j]) \
                    and all(ms[j][k] == ms[i][k] for k in SHARED):
                j += 1
        inner = {s["name"] for s in subs[i:j - 1]}  # outputs only the run's next layer may read
        read_later = any(r.get("op") in inner for s in subs[j:] for r in s.get("inputs", []))
        if j - i >= 2 and all(ms[k]["args"]["x"] == 0 for k in range(i, j)) and _norms_from_args(subs[i], ms[i]) \
                and not read_later:
            runs[i] = {"end": j, "ms": ms[i:j], "subs": subs[i:j]}
        i = j
    return runs


def _chained(prev: dict, sub: dict, m: dict) -> bool:
    """sub reads prev's output as its x and its norms' weights from the step's args."""
    ins = sub.get("inputs", [])
    return len(ins) == 3 and ins[m["args"]["x"]] == {"op": prev["name"]} and _norms_from_args(sub, m)


def _norms_from_args(sub: dict, m: dict) -> bool:
    ins = sub.get("inputs", [])
    return len(ins) == 3 and all(isinstance(ins[m["args"][k]], dict) and list(ins[m["args"][k]]) == ["arg"]
                                 for k in ("n1", "n2"))


def run_layers(R: dict, inp: list, local: dict, ctx, events: list) -> np.ndarray | None:
    """A run of layer_runs as one compiled call (decode_layer.layers_w8a8, layers_q4) for the one row the first
    layer reads: each layer's trace event appended to events (as ops.fused._own_event makes them; its start and end
    from the cycle counter, scaled to the call's measured time), -> the last layer's output float32[1, D], or None
    where the layers must run one by one."""
    ms, subs = R["ms"], R["subs"]
    m0 = ms[0]
    D, H, KV, d = m0["D"], m0["H"], m0["KV"], m0["d"]
    ref = subs[0]["inputs"][0]
    x = inp[ref["arg"]] if "arg" in ref else local.get(ref.get("op"))
    sess = ctx.session
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.shape == (1, D) and sess is not None
            and sess.batch == 1):
        return None
    q4 = m0["scheme"] == "q4_0-tile"
    if q4 and ctx.lane != "npu":  # the cpu lane's q4_0-tile linear is BLAS on the float32 weight: other bits
        return None
    # R is the plan's, shared by its runs: each entry set whole, from the same blobs whichever run sets it
    norms = [inp[s["inputs"][m["args"][k]]["arg"]] for s, m in zip(subs, ms) for k in ("n1", "n2")]
    kept = R.get("norms")
    if kept is None or any(a is not b for a, b in zip(norms, kept[0])):
        if not all(_vec(v, D) for v in norms):
            return None
        kept = R["norms"] = (norms, np.array(norms[0::2]), np.array(norms[1::2]))  # checked once: the same blobs
    pos = sess.length + ctx.offset
    if not 0 <= pos < sess.capacity:
        return None
    layers = tuple(m["layer"] for m in ms)
    kv = sess.extras.get("compiled_kv", {}).get(layers)  # the session's own, one run at a time
    if kv is None or kv[0] is not sess.k or kv[1] is not sess.v:  # a new cache (a reorder makes new arrays)
        kc = [sess.k[i] if 0 <= i < sess.n_layers else None for i in layers]
        vc = [sess.v[i] if 0 <= i < sess.n_layers else None for i in layers]
        if not all(a is not None and a.shape == (1, KV, sess.capacity, d) and a.dtype == np.float32
                   and a.flags.c_contiguous for a in kc + vc):
            return None
        kv = sess.extras.setdefault("compiled_kv", {})[layers] = (sess.k, sess.v, typed(kc), typed(vc))
    if R.get("weights") is None:
        ws = [m.get("weights") or _weights(m, m["groups"], ctx) for m in ms]
        # typed lists of the 4 GEMVs' arrays over the layers (w8a8: w, sa, part, scale; q4_0-tile: codes, d16), and
        # the norms' eps
        R["weights"] = all(ws) and ([typed([w[g][i] for w in ws]) for g in range(4)
                                     for i in ((0, 1) if q4 else (2, 0, 1, 3))],
                                    np.array([m["eps"] for m in ms], np.float32),
                                    decode_layer.empty_lists("w8" if q4 else "q4", len(ms)))
    if not R["weights"]:
        return None
    w, eps, none = R["weights"]
    cos, sin = _rope_tables(d, m0["theta"], pos, 1, None)
    L = len(ms)
    ticks, marks = np.zeros((L, len(decode_layer.PARTS)), np.int64), np.zeros((L, 2), np.int64)
    t0 = perf_counter_ns()
    if q4:
        out = decode_layer.layers_q4(x, kept[1], kept[2], eps, *w, kv[2], kv[3], m0["ko"], m0["vo"], m0["uo"], m0["F"],
                                     H, KV, cos, sin, pos, m0["window"], m0["scale64"], m0["softcap"], ticks, marks,
                                     none)
    else:
        out = decode_layer.layers_w8a8(x, kept[1], kept[2], eps, *w, kv[2], kv[3], H, KV, cos, sin, pos,
                                       m0["window"], m0["scale64"], m0["softcap"], ticks, marks, none)
    t1 = perf_counter_ns()
    ns = (t1 - t0) / max(int(marks[-1, 1] - marks[0, 0]), 1)  # ns a cycle over the call
    c0 = int(marks[0, 0])
    fixed = ctx.sub_event or {}
    nbytes = (x.nbytes + 2 * D * 4, D * 4)
    att = 4 * H * (1 + pos) * d
    for s, m, (a, b), tk in zip(subs, ms, marks.tolist(), ticks.tolist()):
        events.append({**fixed, "name": s["name"], "kind": "fused", "layer": s.get("layer", -1),
                       "deps": s.get("deps", []), "group": s["name"], "start_us": (t0 + (a - c0) * ns) / 1000.0,
                       "end_us": (t0 + (b - c0) * ns) / 1000.0, "bytes_in": nbytes[0], "bytes_out": nbytes[1],
                       "shape": [1, D], "flops": m["flops"] + att, "fused_ops": len(PATTERN),
                       "parts_us": {k: t * ns / 1000.0 for k, t in zip(decode_layer.PARTS, tk)},
                       "compiled_layer": True})
    return out
