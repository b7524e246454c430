"""The neuron predictor of LLM in a flash (§3.1): which FFN neurons a token will use, from a low-rank predictor.

The host's sparse hooks (edgeprobe.neurons) and the agent's ffn_flash op (edgeprobe_agent.neurons) both call this.
"""
from __future__ import annotations

import numpy as np


def predicted_mask(x: np.ndarray, A: np.ndarray, B: np.ndarray, b: np.ndarray, cutoff: float) -> np.ndarray:
    """bool[T, ffn]: sigmoid((x A) B + b) > cutoff for each row of x float32[T, hidden] (A [hidden, r], B [r, ffn],
    b [ffn])."""
    return 1.0 / (1.0 + np.exp(-((x @ A) @ B + b))) > cutoff
