"""Expert buffer policies (EdgeMoE §3.3.3): which expert to evict when a routed expert must be loaded.

Shared by the host simulator (`edgeprobe.profile.expert_cache`) and the device agent, which runs the
same policy on real reads from flash; so this module needs only the standard library and numpy.

An expert is keyed (layer, expert). The buffer holds `capacity` experts. Policies:
  fifo    evict the expert loaded first
  lru     evict the expert used least recently
  lfu     evict the expert used least often since it was loaded (ties: least recent)
  edgemoe evict the expert with the lowest keep score f[l, e] / (1 + d), where f is its profiled
          activation frequency and d = (l - I) mod S its distance ahead of the current layer I in
          execution order (S layers): rarely used experts whose layer comes last go first. The paper's
          formula is garbled in translation (PAPERS.md §3); this is its stated intent.
Experts in use by the current layer are pinned and never evicted.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

POLICIES = ("fifo", "lru", "lfu", "edgemoe")


class ExpertCache:
    """A buffer of `capacity` experts under one eviction policy, counting hits, misses and loads.

    freq: float[L, E] profiled expert frequencies (needed by "edgemoe"); n_layers: S for distances.
    """

    def __init__(self, capacity: int, policy: str = "lru", freq: np.ndarray | None = None,
                 n_layers: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"cache capacity must be a positive number of experts, got {capacity!r}")
        if policy == "edgemoe" and freq is None:
            raise ValueError("the edgemoe policy needs the profiled expert frequencies freq[L, E]")
        self.capacity, self.policy = int(capacity), policy
        self.freq = None if freq is None else np.asarray(freq, np.float64)
        self.S = int(n_layers if n_layers is not None else (self.freq.shape[0] if self.freq is not None else 1))
        self.slots: OrderedDict = OrderedDict()  # key -> [load_order, last_use, uses]; order = load order
        self.clock = 0
        self.hits = self.misses = self.preloads = self.useful_preloads = self.evictions = 0
        self._preloaded: set = set()

    def __contains__(self, key) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def _victim(self, layer_now: int, pinned) -> tuple | None:
        cands = [k for k in self.slots if k not in pinned]
        if not cands:
            return None
        if self.policy == "fifo":
            return cands[0]  # OrderedDict keeps load order
        if self.policy == "lru":
            return min(cands, key=lambda k: self.slots[k][1])
        if self.policy == "lfu":
            return min(cands, key=lambda k: (self.slots[k][2], self.slots[k][1]))
        S, f = self.S, self.freq
        return min(cands, key=lambda k: (f[k[0], k[1]] / (1 + (k[0] - layer_now) % S), self.slots[k][1]))

    def _insert(self, key, layer_now: int, pinned) -> bool:
        if len(self.slots) >= self.capacity:
            v = self._victim(layer_now, pinned)
            if v is None:
                return False  # everything resident is in use: load without keeping it
            del self.slots[v]
            self._preloaded.discard(v)
            self.evictions += 1
        self.slots[key] = [self.clock, self.clock, 0]
        return True

    def access(self, key: tuple, layer_now: int, pinned=()) -> bool:
        """Use expert `key` at layer `layer_now`; load it on a miss. Returns True on a hit."""
        self.clock += 1
        s = self.slots.get(key)
        if s is not None:
            self.hits += 1
            if key in self._preloaded:
                self.useful_preloads += 1
                self._preloaded.discard(key)
            s[1] = self.clock
            s[2] += 1
            return True
        self.misses += 1
        if self._insert(key, layer_now, pinned):
            self.slots[key][2] = 1
        return False

    def preload(self, key: tuple, layer_now: int, pinned=()) -> bool:
        """Load expert `key` ahead of its use (while `layer_now` computes). Returns True if it was read."""
        if key in self.slots:
            return False
        self.clock += 1
        if not self._insert(key, layer_now, pinned):
            return False
        self.preloads += 1
        self._preloaded.add(key)
        return True


def preload_scores(t: dict, layer: int, prev1=None, prev2=None) -> np.ndarray:
    """EdgeMoE §3.3's offline table looked up online: float64[N, E] scores of `layer`'s experts given the
    top-1 experts int[N] of the two previous layers; contexts seen fewer than min_count times back off to
    the next lower order. t: PreloadPredictor.to_arrays() (order, min_count, p0 [L,E], p1 [L,E,E],
    p2 [L,E,E,E], n1 [L,E], n2 [L,E,E])."""
    order, mc = int(t["order"]), int(t["min_count"])
    n = 1 if prev1 is None else len(prev1)
    s = np.broadcast_to(t["p0"][layer], (n, t["p0"].shape[1])).copy()
    if order >= 1 and layer >= 1 and prev1 is not None:
        ok = t["n1"][layer][prev1] >= mc
        s[ok] = t["p1"][layer][prev1[ok]]
        if order >= 2 and layer >= 2 and prev2 is not None:
            ok2 = t["n2"][layer][prev2, prev1] >= mc
            s[ok2] = t["p2"][layer][prev2[ok2], prev1[ok2]]
    return s
