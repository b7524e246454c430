"""Sampling the next token from logits (edgeprobe_kernels.sampling): shared by the agent's decode workflows, test-time
scaling and the host's generate, and importable without ZeroMQ (tts runs on the host alone)."""
from __future__ import annotations

from edgeprobe_kernels.sampling import log_softmax, sample

__all__ = ["sample", "log_softmax"]
