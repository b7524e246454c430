"""A cost model fitted from a real trace (HeteroLLM §4's "predicted" mode, from measured ops instead of one sentence).

Per lane and cost kind (graph.template's: linear, int8_linear, attention, elementwise, ...):
us = fixed_us + us_per_flop * FLOPs + us_per_byte * weight bytes, by non-negative least squares of the relative
error over the aligned ops
(a 1-row matmul is a GEMV, priced by the weights it streams, not its FLOPs). Where the ops' token rows M span a kernel
change (llama.cpp's OpenCL runs kernel_gemv_noshuffle at M=1 and kernel_mul_mat_Ab_Bi_8x4 above), a second set of
coefficients for M below a threshold found from the data (`below`), only when both regimes hold MIN_REGIME ops.
Bytes are the template's weight bytes under the scheme the alignment priced (a config alone: float, 4 per weight),
so a fitted bandwidth prices graphs planned with the same scheme. Held-out error: fit on some layers (or passes),
predict the others. The result is a FittedCostModel (schedule.cost).
"""
from __future__ import annotations

import itertools
import statistics

import numpy as np

from ..schedule.cost import FITTED_JSON_FORMAT as JSON_FORMAT  # noqa: F401  (importable from here as before)
from ..schedule.cost import FittedCostModel, _build_fitted, cost_model, fitted_time_us
from .base import ForeignTraceError

load_cost_model = FittedCostModel.from_json  # a model saved with FittedCostModel.to_json (schedule.cost.load_fitted)

MIN_REGIME = 3        # ops each side of an M threshold needs before the threshold is fitted
SPLIT_GAIN = 0.5      # without kernel names, a threshold is kept only if it at least halves the squared error
_TIE = 1e-9           # relative squared-error margin within which the simpler (or preferred) solution is kept
# FLOPs per weight byte below which an op counts as memory-bound when the data cannot tell FLOPs from bytes (one M):
# an assumption, phones' peak compute over DRAM bandwidth is tens of FLOP/B (Adreno 750: 2.8 TFLOP/s / 77 GB/s ≈ 36);
# the template's float bytes (4 per weight) give M / 2 FLOP/B, so fewer than 32 rows stream their weights
RIDGE_FLOP_PER_BYTE = 16.0


def nnls(columns: dict, y, prefer=("flops", "bytes", "fixed")) -> tuple[dict, float]:
    """Non-negative least squares y ~ sum_c coef_c * columns[c] ({name: float64[n]}), exact: every subset of the
    (at most 3) columns solved by lstsq, the feasible (all coef >= 0, full rank) one of least squared error kept;
    within _TIE of it the fewest columns, then `prefer`'s order (collinear columns: one M makes bytes ∝ FLOPs).
    Returns ({name: coef}, squared error); an all-zero column is left out (coef 0)."""
    y = np.asarray(y, np.float64)
    names = [c for c in prefer if c in columns and np.any(np.asarray(columns[c]) != 0)]
    scale = {c: float(np.max(np.abs(columns[c]))) for c in names}
    cands = []
    for k in range(1, len(names) + 1):
        cands += list(itertools.combinations(names, k))  # fewest columns first, then `prefer`'s order
    best, sols = None, []
    for sub in cands:
        A = np.stack([np.asarray(columns[c], np.float64) / scale[c] for c in sub], 1)
        if np.linalg.matrix_rank(A) < len(sub):
            continue
        x, *_ = np.linalg.lstsq(A, y, rcond=None)
        if np.any(x < 0):
            continue
        r = float(np.sum((A @ x - y) ** 2))
        sols.append((sub, x, r))
        best = r if best is None else min(best, r)
    coef = {c: 0.0 for c in columns}
    if best is None:
        return coef, float(y @ y)
    sub, x, r = next(s for s in sols if s[2] <= best + _TIE * max(float(y @ y), 1e-300))
    for c, v in zip(sub, x):
        coef[c] = float(v / scale[c])
    return coef, r


def _coefs(flops, by, us) -> dict:
    """One regime's coefficients (see nnls) and how well they fit the ops they came from. Equal fits (bytes ∝ FLOPs):
    bytes first below RIDGE_FLOP_PER_BYTE (memory-bound), else FLOPs."""
    bound = by.any() and flops.sum() < RIDGE_FLOP_PER_BYTE * by.sum()
    prefer = ("bytes", "flops", "fixed") if bound else ("flops", "bytes", "fixed")
    # least squares of the relative error (each op's row over its time): the error a prediction is judged by, and
    # a 3 us norm then weighs as much as a 400 us matmul instead of not at all (LFM2 on Hexagon: held-out median
    # error 41% -> 7%, time-weighted 6.3% -> 5.1%)
    w = 1.0 / np.maximum(us, 1e-9)
    coef, _ = nnls({"fixed": w, "flops": flops * w, "bytes": by * w}, np.ones_like(us), prefer)
    a, b, c = coef["fixed"], coef["flops"], coef["bytes"]
    rel = np.abs(a + b * flops + c * by - us) / np.maximum(us, 1e-9)
    out = {"fixed_us": a, "us_per_flop": b, "us_per_byte": c, "rate_gflops": (1e-3 / b) if b > 0 else None,
            "bandwidth_gbs": (1e-3 / c) if c > 0 else None, "n": int(len(us)), "sizes": len(set(flops.tolist())),
            "fit_median_rel_error": float(np.median(rel)),
            # False: bytes ∝ FLOPs in these ops (one M, one weight type), so the data cannot tell the two terms apart
            "bytes_separable": bool(by.any()) and int(np.linalg.matrix_rank(
                np.stack([flops / max(flops.max(), 1e-300), by / max(by.max(), 1e-300)], 1))) == 2,
            "flops_range": [float(flops.min()), float(flops.max())],  # outside them a prediction extrapolates
            "bytes_range": [float(by.min()), float(by.max())]}
    if len(set(zip(flops.tolist(), by.tolist()))) == 1:
        out["degenerate"] = _degenerate(out, float(flops[0]), float(by[0]), float(np.mean(us)))
    return out


def _degenerate(f: dict, flops: float, nbytes: float, us: float) -> str:
    """One line: why a fit on ops of one size cannot split its time into a rate and a fixed per-op cost."""
    term = ("us_per_flop" if f["us_per_flop"] > 0 else "us_per_byte" if f["us_per_byte"] > 0 else "fixed_us")
    size = f"{flops:.6g} FLOPs" + (f", {nbytes:.6g} bytes" if nbytes else "")
    return (f"degenerate: all {f['n']} ops have one size ({size}), so the rate and the fixed per-op cost cannot be "
            f"separated; {term} alone carries their mean {us:.6g} us (an effective figure for this size: other sizes "
            "are extrapolated)")


def _sse(f: dict, flops, by, us) -> float:
    """The squared relative error of a fit over its ops (what _coefs minimizes)."""
    return float(np.sum(((f["fixed_us"] + f["us_per_flop"] * flops + f["us_per_byte"] * by - us)
                         / np.maximum(us, 1e-9)) ** 2))


def _separates(ops, kernels, lo) -> bool:
    """Whether every op seen on both sides of a threshold runs disjoint kernel sets below and above it."""
    sides: dict = {}
    for o, k, b in zip(ops, kernels, lo):
        sides.setdefault(o, (set(), set()))[0 if b else 1].add(k)
    both = [(a, b) for a, b in sides.values() if a and b]
    return bool(both) and all(not (a & b) for a, b in both)


def _main_kernel(kernels) -> str:
    return max(sorted(set(kernels)), key=list(kernels).count)


def fit_line(flops: list, us: list, bytes: list | None = None, rows: list | None = None,
             kernels: list | None = None, ops: list | None = None) -> dict:
    """us = fixed_us + us_per_flop * flops + us_per_byte * bytes, coefficients >= 0 (nnls; equal fits: see
    _coefs). rows (token rows M per op): the threshold t of least squared
    error with MIN_REGIME ops each side gives M < t its own coefficients (`below`). With kernel names and op names
    (the same template op at several M), t must separate kernels: every op seen on both sides runs other kernels
    below t than above, and one op at least is seen on both; without them, t must at least halve the squared error."""
    x, y = np.asarray(flops, np.float64), np.asarray(us, np.float64)
    by = np.zeros_like(x) if bytes is None else np.asarray(bytes, np.float64)
    one = _coefs(x, by, y)
    m = None if rows is None or any(r is None for r in rows) else np.asarray(rows, np.int64)
    if m is None:
        return {**one, "regime": "one: the ops' token rows are not known"}
    one["rows_range"] = [int(m.min()), int(m.max())]
    named = kernels is not None and ops is not None and all(kernels) and all(ops)
    distinct = sorted(set(m.tolist()))
    best, why = None, (f"one: every op has M = {distinct[0]}" if len(distinct) == 1 else
                       f"one: fewer than {MIN_REGIME} ops on each side of every M threshold")
    for t in distinct[1:]:
        lo, hi = m < t, m >= t
        if lo.sum() < MIN_REGIME or hi.sum() < MIN_REGIME:
            continue
        if named and not _separates(ops, kernels, lo):
            why = "one: no M threshold separates the kernels an op runs"
            continue
        flo, fhi = _coefs(x[lo], by[lo], y[lo]), _coefs(x[hi], by[hi], y[hi])
        sse = _sse(flo, x[lo], by[lo], y[lo]) + _sse(fhi, x[hi], by[hi], y[hi])
        if not named and sse > SPLIT_GAIN * _sse(one, x, by, y):
            why = "one: no M threshold halves the squared error"
            continue
        if best is None or sse < best[0]:
            best = (sse, t, flo, fhi, lo, hi)
    if best is None:
        return {**one, "regime": why}
    _, t, flo, fhi, lo, hi = best
    kern = lambda sel: sorted({k for k, b in zip(kernels, sel) if b}) if named else None
    return {**fhi, "rows_range": [int(m[hi].min()), int(m[hi].max())], "kernels": kern(hi),
            "regime": f"two: M < {t} and M >= {t}" + (f" ({_main_kernel([k for k, b in zip(kernels, lo) if b])} / "
                                                      f"{_main_kernel([k for k, b in zip(kernels, hi) if b])})"
                                                      if named else ""),
            "below": {**flo, "rows_lt": int(t), "rows_range": [int(m[lo].min()), int(m[lo].max())],
                      "kernels": kern(lo)}}


def _op_name(s: dict) -> str | None:
    """The op a sample measures (its template ops, else the trace's name): one op seen at several M."""
    return "+".join(s["template_ops"]) if s.get("template_ops") else s.get("name")


def fit_samples(samples: list) -> dict:
    """{lane: {kind: fit_line(...)}} over samples [{lane, kind, flops, us, bytes?, rows?, kernel?}]."""
    groups: dict = {}
    for s in samples:
        groups.setdefault(s["lane"], {}).setdefault(s["kind"], []).append(s)
    return {lane: {k: fit_line([s["flops"] for s in v], [s["us"] for s in v], [s.get("bytes", 0) for s in v],
                               [s.get("rows") for s in v], [s.get("kernel") for s in v], [_op_name(s) for s in v])
                for k, v in kinds.items()}
            for lane, kinds in groups.items()}


def held_out(samples: list, train_layers=None) -> dict:
    """Fit on samples of `train_layers` (default: even layers; one layer: even passes; without layers, even-indexed
    samples), predict the rest:
    per predicted sample its relative error; ops of a lane and kind absent from the training part are counted apart."""
    layers = sorted({s["layer"] for s in samples})
    passes = sorted({s.get("pass", 0) for s in samples})
    blocks = [l for l in layers if l >= 0]  # -1: ops outside the layers (the LM head) go with their pass
    if len(blocks) == 1 and len(passes) > 1 and train_layers is None:
        # one layer (a draft model, a one-layer benchmark): fit on the even forward passes, predict the odd ones
        train = [s for s in samples if s.get("pass", 0) % 2 == 0]
        test = [s for s in samples if s.get("pass", 0) % 2 == 1]
        split = f"one layer: fit on passes {passes[0::2]}, predict passes {passes[1::2]}"
    elif layers == [-1] or not layers:
        train = [s for i, s in enumerate(samples) if i % 2 == 0]
        test = [s for i, s in enumerate(samples) if i % 2 == 1]
        split = "even-indexed samples / odd-indexed samples (no layers in the trace)"
    else:
        tl = set(train_layers) if train_layers is not None else {l for l in layers if l % 2 == 0}
        train = [s for s in samples if s["layer"] in tl]
        test = [s for s in samples if s["layer"] not in tl]
        split = f"fit on layers {sorted(tl)}, predict layers {sorted({s['layer'] for s in test})}"
    if not train or not test:
        raise ForeignTraceError("samples", "held-out split", f"{len(train)} training and {len(test)} held-out samples",
                                "samples on at least two layers (or two samples)")
    fits = fit_samples(train)
    errs, weights, unseen = [], [], 0
    for s in test:
        f = fits.get(s["lane"], {}).get(s["kind"])
        if f is None:
            unseen += 1
            continue
        errs.append(abs(fitted_time_us(f, s["flops"], s.get("bytes", 0), s.get("rows")) - s["us"]) / s["us"])
        weights.append(s["us"])
    degen = sorted(f"{lane}/{kind}" for lane, kinds in fits.items() for kind, f in kinds.items() if "degenerate" in f)
    return {"split": split, "n_train": len(train), "n_predicted": len(errs), "n_unseen_kind": unseen,
            "degenerate_training_fits": degen,
            "median_rel_error": float(np.median(errs)) if errs else None,
            "mean_rel_error": float(np.mean(errs)) if errs else None,
            "max_rel_error": float(max(errs)) if errs else None,
            "time_weighted_rel_error": float(np.average(errs, weights=weights)) if errs else None}


def samples_from_events(trace) -> list[dict]:
    """Fitting samples from a trace's own FLOP counts (no template: e.g. a single-op benchmark log, a QNN optrace).
    Events with flops 0 (data movement, layout changes) are left out: their `bytes` are their tensor's, not the
    weight bytes a fitted us_per_byte prices, and a lane of them alone would hide the base model's rates."""
    out = [{"lane": e["lane"], "kind": e["kind"], "flops": e["flops"], "us": e["end_us"] - e["start_us"],
            "layer": e.get("layer", -1), "bytes": e.get("bytes", 0), "rows": _rows(e), "kernel": e.get("kernel"),
            "name": e.get("name")}
           for e in trace.events if e.get("flops")]
    if not out:
        raise ForeignTraceError(trace.meta.get("path", "trace"), "events", "no event with a FLOP count",
                                "events with flops (or align the trace to a model first)")
    return out


def fit(source, name: str = "fitted", base: str | None = "snapdragon-8gen3", train_layers=None,
        sync_us: float | None = None) -> FittedCostModel:
    """A FittedCostModel from an Alignment (align.align: template FLOPs of the matched ops) or a Trace whose events
    carry FLOPs. held_out: the error of a fit on some layers predicting the others; the model is then fit on all."""
    if hasattr(source, "samples"):
        samples, meta = source.samples(), source.trace.meta
    else:
        samples, meta = samples_from_events(source), source.meta
    if not samples:
        raise ForeignTraceError(meta.get("path", "trace"), "alignment", "no event aligned to a template op",
                                "an alignment with matched ops")
    held = held_out(samples, train_layers) if len(samples) >= 2 else {}
    base_model = cost_model(base) if base else None
    sync = sync_us if sync_us is not None else (base_model.sync_us if base_model is not None else 0.0)
    src = meta.get("source", {})
    fits = fit_samples(samples)
    degen = [f"{lane}/{kind}" for lane, kinds in fits.items() for kind, f in kinds.items()
             if "degenerate" in f or "degenerate" in f.get("below", {})]
    desc = (f"fitted from a measured trace ({src.get('tool', '?')}, {src.get('format', '?')}): {len(samples)} ops; "
            f"held-out median error {held.get('median_rel_error')}; other lanes from {base or 'nothing'}"
            + (f"; degenerate (one size: rate and fixed cost not separable): {', '.join(degen)}" if degen else ""))
    return _build_fitted(name, fits, base, desc, sync, {}, held,
                  {"source": src, "path": meta.get("path"), "n_samples": len(samples),
                   "median_us": statistics.median(s["us"] for s in samples)})


def _rows(e: dict) -> int | None:
    """An event's token rows M: as its reader states them, or a matmul's activation columns (ggml's src1 ne[1])."""
    if e.get("rows"):
        return int(e["rows"])
    shapes = e.get("input_shapes")
    return int(shapes[1][1]) if e["kind"].startswith("MUL_MAT") and shapes and len(shapes) > 1 else None

