"""The predicted schedule of a quantized model's chunked prefill: the one computation behind `edgeprobe schedule`,
`edgeprobe run --scheduler in-order|ooo` (workflows.prefill_chunked) and the demo's predictions."""
from __future__ import annotations

from .graph import chunk_graph
from .schedulers import schedule


def predicted_schedule(manifest: dict, prompt_len: int, chunk: int, scheduler: str, cost):
    """A QuantizedModel's manifest -> (ChunkGraph, Schedule) over `cost` (a CostModel object).

    The graph comes from the manifest's records, so the scheme's shadow-outlier GEMMs are the layers it keeps
    (mllm-NPU prunes the outliers of the 85% least important layers), not every layer."""
    from ..models import ModelConfig

    graph = chunk_graph(ModelConfig(**manifest["config"]), prompt_len, chunk, manifest=manifest)
    return graph, schedule(graph, cost, scheduler)
