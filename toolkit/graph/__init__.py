"""The model as one graph of ops (template), placed on lanes (place), run on the host (local).

config -> template (ops, once) -> placed plan -> cost model | host executor | agent -> trace.
"""
from .place import DEFAULT_STAGE_LANES, lane_by_kind, order_by_schedule, place_by_kind, place_by_stage
from .template import GRAPH_VERSION, INT8_KINDS, NPU_KINDS, STAGES, GraphError, Weights, model_ops

__all__ = ["GRAPH_VERSION", "model_ops", "Weights", "GraphError", "STAGES", "NPU_KINDS", "INT8_KINDS", "place_by_kind",
           "place_by_stage", "order_by_schedule", "lane_by_kind", "DEFAULT_STAGE_LANES"]
