"""A cost model fitted from a real trace (HeteroLLM §4's "predicted" mode, from measured ops instead of one sentence).

Per lane and cost kind (graph.template's: linear, int8_linear, attention, elementwise, ...) a fixed cost per op and a
time per FLOP, by least squares over aligned ops: us = fixed_us + us_per_flop * FLOPs. One size only: the fixed
cost is 0 and the rate is the mean (said so in `sizes`). Held-out error: fit on some layers, predict the others.
The result is a FittedCostModel (schedule.cost, beside the named ones) usable wherever a cost model is.
"""
from __future__ import annotations

import statistics

import numpy as np

from ..schedule.cost import FITTED_JSON_FORMAT as JSON_FORMAT  # noqa: F401  (importable from here as before)
from ..schedule.cost import FittedCostModel, _build_fitted, cost_model
from ..schedule.cost import load_fitted as load_cost_model  # noqa: F401
from .base import ForeignTraceError


def fit_line(flops: list, us: list) -> dict:
    """Least squares us = fixed_us + us_per_flop * flops, both >= 0 (negative fixed -> through the origin)."""
    x, y = np.asarray(flops, np.float64), np.asarray(us, np.float64)
    sizes = len(set(x.tolist()))
    if sizes >= 2:
        b, a = np.polyfit(x, y, 1)
        if a < 0 or b <= 0:
            a, b = 0.0, float(x @ y / (x @ x)) if (x @ x) > 0 else 0.0
            if b <= 0:
                a, b = float(y.mean()), 0.0
    else:
        a, b = (0.0, float(y.mean() / x.mean())) if x.mean() > 0 else (float(y.mean()), 0.0)
    pred = a + b * x
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    return {"fixed_us": float(a), "us_per_flop": float(b), "rate_gflops": (1e-3 / b) if b > 0 else None,
            "n": int(len(x)), "sizes": sizes, "fit_median_rel_error": float(np.median(rel)),
            "flops_range": [float(x.min()), float(x.max())]}  # outside it a prediction extrapolates


def fit_samples(samples: list) -> dict:
    """{lane: {kind: fit_line(...)}} over samples [{lane, kind, flops, us}]."""
    groups: dict = {}
    for s in samples:
        groups.setdefault(s["lane"], {}).setdefault(s["kind"], []).append(s)
    return {lane: {k: fit_line([s["flops"] for s in v], [s["us"] for s in v]) for k, v in kinds.items()}
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
        errs.append(abs(f["fixed_us"] + f["us_per_flop"] * s["flops"] - s["us"]) / s["us"])
        weights.append(s["us"])
    return {"split": split, "n_train": len(train), "n_predicted": len(errs), "n_unseen_kind": unseen,
            "median_rel_error": float(np.median(errs)) if errs else None,
            "mean_rel_error": float(np.mean(errs)) if errs else None,
            "max_rel_error": float(max(errs)) if errs else None,
            "time_weighted_rel_error": float(np.average(errs, weights=weights)) if errs else None}


def samples_from_events(trace) -> list[dict]:
    """Fitting samples from a trace's own FLOP counts (no template: e.g. a single-op benchmark log)."""
    out = [{"lane": e["lane"], "kind": e["kind"], "flops": e["flops"], "us": e["end_us"] - e["start_us"],
            "layer": e.get("layer", -1)} for e in trace.events if e.get("flops")]
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
    desc = (f"fitted from a measured trace ({src.get('tool', '?')}, {src.get('format', '?')}): {len(samples)} ops; "
            f"held-out median error {held.get('median_rel_error')}; other lanes from {base or 'nothing'}")
    return _build_fitted(name, fit_samples(samples), base, desc, sync, {}, held,
                  {"source": src, "path": meta.get("path"), "n_samples": len(samples),
                   "median_us": statistics.median(s["us"] for s in samples)})
