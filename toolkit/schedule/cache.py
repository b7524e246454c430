"""Cost models by the names the command line takes (`--cost-model`), measured ones cached per model and scheme.

A name is a named modelled cost model (cost.COST_MODELS), a measured cost model's .json, or `measured` /
`measured-real`: HeteroLLM's profiler (§4.2) run on an agent, saved under the edgeprobe cache so the next
command reuses it, and read back in its "predicted" or "real" mode.
"""
from __future__ import annotations

from pathlib import Path

MEASURED = ("measured", "measured-real")


def cache_path(model_name: str, scheme: str) -> Path:
    """Where the cost model measured for `model_name` under `scheme` is kept (the folder keeps its first name,
    `profiles/`, so cost models measured before still load)."""
    from ..models import default_cache_dir

    return default_cache_dir() / "profiles" / f"{Path(model_name).name}-{scheme}.json"


def mode_of(name: str) -> str:
    """measured-real -> "real" (the measured table), measured -> "predicted" (the fit)."""
    return "real" if name == "measured-real" else "predicted"


def cached(name: str, model_name: str, scheme: str):
    """The cached measured cost model for `name` (measured / measured-real), or None when none is cached."""
    from .measure import MeasuredCostModel

    path = cache_path(model_name, scheme)
    return MeasuredCostModel.from_json(path, mode_of(name)) if path.exists() else None


def resolve(name: str, model_name: str, qm=None, dev=None, tokens=None, progress: bool = True,
            remeasure: bool = False, cache: bool = True):
    """A cost model for `--cost-model name`: a named one, a measured one's .json, or measured / measured-real:
    measured on the agent `dev` over `tokens` (int ids of real text) for `qm` and cached per model and scheme
    (unless cache is False: a farm measures each device for itself); remeasure: ignore a cached one."""
    from .cost import cost_model

    if name not in MEASURED:
        return cost_model(name)
    if not remeasure:
        hit = cached(name, model_name, qm.scheme)
        if hit is not None:
            return hit
    measured = dev.measure_cost_model(qm, tokens, progress=progress)
    if cache:
        measured.to_json(cache_path(model_name, qm.scheme))
    return measured.with_mode(mode_of(name))
