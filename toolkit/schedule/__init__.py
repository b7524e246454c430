"""Chunked-prefill scheduling (mllm-NPU §3.2, §3.4): chunk graphs, cost models, schedulers, predicted traces."""
from .cost import PROFILES, DeviceProfile, device_profile
from .graph import ChunkGraph, ScheduleError, Subgraph, chunk_graph
from .hetero import HETERO_PROFILES, STRATEGIES, HeteroProfile, choices_for, compare_strategies, decode_choices, solve
from .measure import MeasuredProfile, measure_linears, measure_profile
from .schedulers import SCHEDULERS, Schedule, exact, in_order, out_of_order, schedule

__all__ = ["chunk_graph", "ChunkGraph", "Subgraph", "ScheduleError", "DeviceProfile", "device_profile", "PROFILES",
           "Schedule", "schedule", "in_order", "out_of_order", "exact", "SCHEDULERS", "HeteroProfile",
           "HETERO_PROFILES", "solve", "compare_strategies", "choices_for", "decode_choices", "STRATEGIES", "MeasuredProfile",
           "measure_profile", "measure_linears"]
