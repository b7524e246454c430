"""Decode sessions: a KV cache that stays on the agent across runs (one prefill, then decode steps).

A session holds, per layer, keys and values float32[batch, n_kv_heads, capacity, head_dim] filled to
`length`. A run that names the session writes its new positions at `length..length+T-1` and attends over
`0..length+T-1`; `length` advances only when the whole run succeeded, so a failed or cancelled step
leaves the cache as it was. `reorder` keeps / copies batch rows: fork one prefilled prompt into B
candidates (test-time scaling) or keep the surviving beams of a beam search.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .ops.registry import OpError


@dataclass
class KVSession:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    batch: int
    capacity: int
    length: int = 0
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    extras: dict = field(default_factory=dict)  # other per-session state kept across steps (neuron windows)

    def __post_init__(self):
        shape = (self.batch, self.n_kv_heads, self.capacity, self.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(self.n_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(self.n_layers)]

    @staticmethod
    def nbytes_for(n_layers, n_kv_heads, head_dim, batch, capacity) -> int:
        return 2 * n_layers * batch * n_kv_heads * capacity * head_dim * 4

    @property
    def nbytes(self) -> int:
        return self.nbytes_for(self.n_layers, self.n_kv_heads, self.head_dim, self.batch, self.capacity)

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray):
        """k, v: float32[batch, T, n_kv_heads, head_dim] at positions start..start+T-1 -> the layer's whole
        cache, keys and values float32[batch, n_kv_heads, capacity, head_dim]: positions start+T.. are not
        this sequence's yet (attention() reads the first start+T)."""
        B, T = k.shape[:2]
        if B != self.batch:
            raise OpError("bad_input", f"the session holds {self.batch} sequences, the run sent {B}")
        if not 0 <= layer < self.n_layers:
            raise OpError("bad_attrs", f"layer {layer} outside the session's {self.n_layers} layers")
        if start + T > self.capacity:
            raise OpError("context_full", f"{start + T} positions exceed the session's capacity {self.capacity}; "
                                          "open a session with a larger capacity")
        self.k[layer][:, :, start:start + T] = k.transpose(0, 2, 1, 3)
        self.v[layer][:, :, start:start + T] = v.transpose(0, 2, 1, 3)
        return self.k[layer], self.v[layer]

    def settle(self) -> None:
        """Wait for I/O the session's runs started (expert preloads), so a run's reply reports all its reads."""
        buf = self.extras.get("experts", {}).get("buffer")
        if buf is not None:
            buf.settle()

    def close(self) -> None:
        """Stop the session's I/O thread (expert buffer), if it has one."""
        buf = self.extras.get("experts", {}).get("buffer")
        if buf is not None:
            buf.close()

    def reorder(self, indices) -> None:
        """New batch row j = old row indices[j] (any length: fork, prune, duplicate)."""
        idx = np.asarray(indices)
        if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= self.batch:
            raise OpError("bad_request", f"reorder indices must be a non-empty list of rows in [0, {self.batch})")
        if self.extras.get("neurons") and idx.size != 1:
            raise OpError("bad_request", "neuron streaming decodes one sequence; do not fork its session")
        self.k = [np.ascontiguousarray(a[idx]) for a in self.k]
        self.v = [np.ascontiguousarray(a[idx]) for a in self.v]
        self.batch = int(idx.size)
