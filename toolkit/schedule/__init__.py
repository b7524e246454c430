"""Chunked-prefill scheduling (mllm-NPU §3.2, §3.4): chunk graphs, cost models, schedulers, predicted traces.

A device's speeds are its *cost model* (CostModel, MeasuredCostModel, HeteroCostModel); the old names
(DeviceProfile, MeasuredProfile, HeteroProfile, device_profile, measure_profile, PROFILES, HETERO_PROFILES)
stay importable."""
from .cost import COST_MODELS, PROFILES, CostModel, DeviceProfile, cost_model, device_profile
from .graph import ChunkGraph, ScheduleError, Subgraph, chunk_graph
from .hetero import (
                     HETERO_COST_MODELS,
                     HETERO_PROFILES,
                     STRATEGIES,
                     HeteroCostModel,
                     HeteroProfile,
                     choices_for,
                     compare_strategies,
                     decode_choices,
                     solve,
)
from .measure import MeasuredCostModel, MeasuredProfile, measure_cost_model, measure_linears, measure_profile
from .predict import predicted_schedule
from .schedulers import SCHEDULERS, Schedule, exact, in_order, out_of_order, schedule

__all__ = ["chunk_graph", "ChunkGraph", "Subgraph", "ScheduleError", "CostModel", "cost_model", "COST_MODELS",
           "Schedule", "schedule", "in_order", "out_of_order", "exact", "SCHEDULERS", "HeteroCostModel",
           "HETERO_COST_MODELS", "solve", "compare_strategies", "choices_for", "decode_choices", "STRATEGIES",
           "MeasuredCostModel", "measure_cost_model", "measure_linears", "predicted_schedule",
           # the old names
           "DeviceProfile", "device_profile", "PROFILES", "HeteroProfile", "HETERO_PROFILES", "MeasuredProfile",
           "measure_profile"]
