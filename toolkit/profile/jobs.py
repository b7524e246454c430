"""The profile jobs behind `edgeprobe profile ...` and the notebooks: calibrate, stream, summarize, draw."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..models import Model
from .figures import OUTLIER_KINDS, SPARSITY_KINDS, write_html
from .outliers import OutlierStats, calibrate_clips
from .predictor import train_predictors
from .runner import run, windows
from .sparsity import SparsityStats, calibrate_thresholds


def profile_outliers(model: Model, ids, tokens: int | None = 32768, window: int = 512, percentile: float = 99.99,
                     calib_tokens: int = 8192, progress: bool = True) -> OutlierStats:
    """Calibrate per-tensor clips on the first `calib_tokens`, then stream `tokens` into OutlierStats."""
    windows(ids, window, tokens)  # validates before any work
    clips = calibrate_clips(model, ids, percentile, window, min(calib_tokens, tokens or len(ids)), progress)
    st = OutlierStats.for_model(model, clips, percentile)
    return run(model, ids, st, window=window, max_tokens=tokens, progress=progress, desc="outliers")


def profile_sparsity(model: Model, ids, tokens: int | None = 16384, window: int = 512, eps: float = 0.01,
                     progress: bool = True) -> SparsityStats:
    """Calibrate per-layer thresholds on the first window, then stream `tokens` into SparsityStats."""
    windows(ids, window, tokens)
    taus = calibrate_thresholds(model, ids, eps, tokens=window)
    st = SparsityStats.for_model(model, taus, eps, act_fn=model.config.act_fn)
    return run(model, ids, st, window=window, max_tokens=tokens, progress=progress, desc="sparsity")


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
                     coverage=0.8, progress=True) -> dict:
    st = profile_outliers(model, ids, tokens, window, percentile, progress=progress)
    summary = st.summary(coverage, prune_rate)
    write_outputs(st, out_dir, summary, OUTLIER_KINDS)
    return summary


def run_sparsity_job(model: Model, ids, out_dir, tokens=16384, window=512, eps=0.01, bits=4.0, rank=32,
                     predictor=True, progress=True) -> dict:
    st = profile_sparsity(model, ids, tokens, window, eps, progress=progress)
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
