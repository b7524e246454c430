"""The profile jobs behind `edgeprobe profile ...` and the notebooks: calibrate, stream, summarize, draw."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..models import Model
from .figures import OUTLIER_KINDS, SPARSITY_KINDS, write_html
from .outliers import CHANNEL_CLIP_PERCENTILE, ClipHistograms, OutlierStats
from .predictor import train_predictors
from .runner import Handover, run, windows
from .sparsity import SparsityStats, calibrate_thresholds

# runner: how a streaming pass over windows runs — runner.run in this process (None), or a
# profile.cluster.RayRunner that shards it over a Ray cluster; both give the same profile.

def profile_outliers(model: Model, ids, tokens: int | None = 32768, window: int = 512, percentile: float = 99.99,
                     calib_tokens: int = 8192, progress: bool = True, runner=None,
                     order: str = "window") -> OutlierStats:
    """Calibrate per-tensor clips on the first `calib_tokens`, then stream `tokens` into OutlierStats (order:
    runner.run's, "window" or "layer"; a Ray runner runs each shard's windows in that order).

    In this process the calibration keeps what the outlier pass counts of its windows (ClipHistograms keep), so
    those windows are replayed instead of run again: the same profile bit for bit, in about half the time when the
    two cover the same tokens (calibration_profile). Window-major, the tokens past calib_tokens then stream in the
    same pass (runner.Handover), so its windows run side by side across the handover; where too few entries were
    kept to replay, the outlier pass runs every window again."""
    n_windows = len(windows(ids, window, tokens))  # validates before any work
    calib_n = min(calib_tokens, tokens or len(ids))
    keep = runner is None  # a runner's shards keep nothing (their entries would have to travel back): two passes
    hists = ClipHistograms.for_model(model, keep=percentile if keep else None)

    def outlier_stats(h: ClipHistograms) -> OutlierStats:
        at = h.clips_at({percentile, CHANNEL_CLIP_PERCENTILE})
        return OutlierStats.for_model(model, at[float(percentile)], percentile,
                                      clips_at={p: c for p, c in at.items() if p != float(percentile)})

    def replayed(h: ClipHistograms, st: OutlierStats) -> bool:
        """st given what the outlier pass counts of the calibration's windows, from h's kept entries, and those
        freed; False (nothing done) where h kept too few for st's clips."""
        if not h.replayable(st.params["clips"]):
            return False
        st.replay(h, done)
        h.kept = None  # the entries are spent: freed before the rest of the pass
        return True

    done = windows(ids, window, calib_n)
    if keep and order == "window" and n_windows > len(done):
        # one pass: the calibration's windows, then the outlier pass's, side by side across the handover
        made = {}

        def then(h: ClipHistograms) -> OutlierStats:
            st = made["st"] = outlier_stats(h)
            if not replayed(h, st):
                raise _Rerun
            return st
        try:
            return run(model, ids, Handover(hists, len(done), then), window=window, max_tokens=tokens,
                       progress=progress, desc="calibrate, outliers").second
        except _Rerun:
            return run(model, ids, made["st"], window=window, max_tokens=tokens, progress=progress, desc="outliers",
                       order=order)
    # layer-major: the calibration too, else it holds every layer's weights (its histograms are counts: same bits)
    hists = (runner or run)(model, ids, hists, window=window, max_tokens=calib_n, progress=progress,
                            desc="calibrate", order=order)
    st = outlier_stats(hists)
    if replayed(hists, st):
        rest = np.asarray(ids)[len(done) * window:tokens]
        if len(rest) >= window:
            run(model, rest, st, window=window, progress=progress, desc="outliers", order=order)
        return st
    return (runner or run)(model, ids, st, window=window, max_tokens=tokens, progress=progress, desc="outliers",
                           order=order)


class _Rerun(Exception):
    """The calibration kept too few entries to replay: the outlier pass runs every window (profile_outliers)."""


def profile_sparsity(model: Model, ids, tokens: int | None = 16384, window: int = 512, eps: float = 0.01,
                     progress: bool = True, runner=None, order: str = "window") -> SparsityStats:
    """Calibrate per-layer thresholds on the first window (here), then stream `tokens` into SparsityStats (order:
    runner.run's, "window" or "layer")."""
    windows(ids, window, tokens)
    taus = calibrate_thresholds(model, ids, eps, tokens=window)
    st = SparsityStats.for_model(model, taus, eps, act_fn=model.config.act_fn)
    return (runner or run)(model, ids, st, window=window, max_tokens=tokens, progress=progress, desc="sparsity",
                           order=order)


def write_outputs(stats, out_dir, summary: dict, kinds) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats.save(out / f"{stats.KIND}.npz")
    for k in kinds:
        write_html(stats.figure(k), out / f"{stats.KIND}_{k}.html")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=_num) + "\n")
    return out


def _num(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(type(v))


def run_outliers_job(model: Model, ids, out_dir, tokens=32768, window=512, percentile=99.99, prune_rate=0.85,
                     coverage=0.8, progress=True, runner=None, order="window") -> dict:
    st = profile_outliers(model, ids, tokens, window, percentile, progress=progress, runner=runner, order=order)
    summary = st.summary(coverage, prune_rate)
    write_outputs(st, out_dir, summary, OUTLIER_KINDS)
    return summary


def run_sparsity_job(model: Model, ids, out_dir, tokens=16384, window=512, eps=0.01, bits=4.0, rank=32,
                     predictor=True, progress=True, runner=None, order="window") -> dict:
    st = profile_sparsity(model, ids, tokens, window, eps, progress=progress, runner=runner, order=order)
    summary = st.summary(bits)
    if predictor:
        # train on the profiled tokens' first windows, test on the window after them
        usable = len(windows(ids, window, tokens)) * window
        n_train = max(window, min(2 * window, usable - window))
        test = ids[n_train:n_train + window]
        if len(test) == window:
            rep = train_predictors(model, ids[:n_train], test, st.params["thresholds"], rank=rank,
                                   window=window, progress=progress)
            summary["predictor"] = rep.summary()
    write_outputs(st, out_dir, summary, SPARSITY_KINDS)
    return summary


def run_experts_job(model: Model, ids, heldout_ids, out_dir, tokens=32768, window=256, heldout_tokens=8192,
                    capacities=None, preload_n=None, cache_bits=4, bit_widths=False, bits_windows=4,
                    tolerances=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5), progress=True, runner=None,
                    order="window") -> dict:
    """EdgeMoE's measurements on one MoE model: co-activation profile of `tokens` of `ids` (through `runner`),
    preload predictor hit rates and expert-buffer policies on `heldout_tokens` of `heldout_ids`, and, with
    `bit_widths`, the per-expert INT2 sensitivity and width selections (on the first windows of `ids`)."""
    from ..quant.expert_bits import ExpertBitsStudy, expert_nbytes
    from .expert_cache import sweep
    from .expert_figures import cache_figure
    from .experts import CoActivationStats, record_routing, require_moe

    require_moe(model)
    windows(ids, window, tokens)
    windows(heldout_ids, window, heldout_tokens)
    c = model.config
    st = (runner or run)(model, ids, CoActivationStats.for_model(model), window=window, max_tokens=tokens,
                         progress=progress, desc="co-activation", order=order)
    held = record_routing(model, heldout_ids, window, heldout_tokens, progress=progress)
    summary = st.summary(held)
    total = c.n_layers * c.n_experts
    caps = sorted({max(c.n_experts_used, int(round(f * total))) for f in (0.125, 0.25, 0.375, 0.5, 0.75)}
                  if capacities is None else {int(x) for x in capacities})
    eb = expert_nbytes(c, cache_bits)
    rows = sweep(held, caps, st.a["freq"], st.predictor(2), preload_n=preload_n, expert_bytes=eb, progress=progress)
    summary["cache"] = {"expert_bytes": eb, "expert_bits": cache_bits, "capacities": caps, "rows": rows}
    out = Path(out_dir)
    write_outputs(st, out, summary, ("frequency", "paths", "conditional"))
    write_html(st.figure("predictor", heldout=held), out / "coactivation_predictor.html")
    write_html(cache_figure(rows, eb, f"{model.name}, {held.tokens:,} held-out tokens, experts at INT{cache_bits} "
                            f"({eb / 1e3:.0f} kB each)"), out / "cache_policies.html")
    held.save(out / "routing_heldout.npz")
    if bit_widths:
        study = ExpertBitsStudy(model, ids, window=window, max_windows=bits_windows, progress=progress)
        study.measure_sensitivity()
        sels = study.curve(tolerances)
        summary["bit_widths"] = {**study.summary(), "selections": [s.to_dict() for s in sels]}
        write_html(study.figure("sensitivity"), out / "bits_sensitivity.html")
        write_html(study.figure("tolerance", sels), out / "bits_tolerance.html")
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=_num) + "\n")
    return summary
