"""The predicted schedule of a model's chunked prefill: the one computation behind `edgeprobe schedule`,
`edgeprobe run --scheduler in-order|ooo` (workflows.prefill_chunked), the demo's predictions and notebook 08."""
from __future__ import annotations

from pathlib import Path

from .graph import chunk_graph
from .schedulers import schedule


def plan_of(model, scheme: str = "w8a8-shadow") -> dict:
    """What predicted_schedule reads, from a QuantizedModel's manifest (returned as is) or a model known only by its
    configuration — a ModelConfig, a Model (config-only or not: its config), a config.json path or folder (any path
    models.load reads) — planned with `scheme`'s stand-in records (models.plan_manifest: float, w8a8, w8a8-shadow)."""
    from .. import models
    from ..models import ModelConfig
    from ..models.config import plan_manifest

    if isinstance(model, dict) and "config" in model:
        return model
    if isinstance(model, (str, Path)):
        path = Path(model)
        if path.is_dir() and (path / "config.json").is_file():
            path = path / "config.json"  # an HF folder plans from its config: its weights are not read nor hashed
        model = models.load(path)
    cfg = getattr(model, "config", model)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"predicted_schedule needs a QuantizedModel's manifest, a ModelConfig, a Model or a "
                        f"config.json path, not {type(model).__name__}")
    return plan_manifest(cfg, scheme)


def predicted_schedule(manifest, prompt_len: int, chunk: int, scheduler: str, cost, scheme: str = "w8a8-shadow"):
    """A model -> (ChunkGraph, Schedule) over `cost` (a CostModel object).

    manifest: a QuantizedModel's manifest — the graph comes from its records, so the scheme's shadow-outlier GEMMs
    are the layers it keeps (mllm-NPU prunes the outliers of the 85% least important layers), not every layer — or a
    config-only model (see plan_of), planned under `scheme`. A cost model that prices op by op (a FittedCostModel:
    weight bytes and token rows per op) is bound to the graph first."""
    from ..models import ModelConfig

    manifest = plan_of(manifest, scheme)
    graph = chunk_graph(ModelConfig(**manifest["config"]), prompt_len, chunk, manifest=manifest)
    if hasattr(cost, "for_graph"):
        cost = cost.for_graph(graph)
    return graph, schedule(graph, cost, scheduler)
