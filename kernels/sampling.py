"""What a decode loop does with logits: log-probabilities and the next token's draw, one copy for host and agent.

The host's generate, test-time scaling and the agent workflows' host loop all sample here, so the same seed gives
the same tokens wherever the logits are the same.
"""
from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float[..., vocab] -> float64 log-probabilities (stable: max subtracted first)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """logits float[B, vocab] -> int64[B]: argmax at temperature 0, else one draw per row from softmax(logits / T)
    (inverse CDF: the first token whose cumulative probability exceeds a uniform draw of rng.random)."""
    if temperature <= 0:
        return np.argmax(logits, axis=-1)
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    u = rng.random((p.shape[0], 1))
    return np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), p.shape[1] - 1)
