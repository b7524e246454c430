"""Quantizers of the five papers: w8a8, w8a8-shadow (mllm-NPU), smoothquant, llm-int8, q4_0,
q4_0-tile (NPU test-time scaling), moe-mixed (EdgeMoE per-expert widths); each yields a
QuantizedModel that the one forward pass runs."""
from .expert_bits import ExpertBitsStudy, Selection
from .qmodel import QuantizedModel, calibration_profile, quantize, schemes_for
from .schemes import SCHEMES

__all__ = ["QuantizedModel", "quantize", "calibration_profile", "schemes_for", "SCHEMES", "ExpertBitsStudy",
           "Selection"]
