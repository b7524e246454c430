"""Sampling the next token from logits: shared by the agent's decode workflows and test-time scaling, and
importable without ZeroMQ (tts runs on the host alone)."""
from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, temperature: float, rng) -> np.ndarray:
    """logits float[B, vocab] -> int64[B]: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature <= 0:
        return np.argmax(logits, axis=-1)
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    u = rng.random((p.shape[0], 1))
    return np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), p.shape[1] - 1)
