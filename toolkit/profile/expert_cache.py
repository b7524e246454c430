"""Expert-buffer simulation on real routing traces (EdgeMoE §3.3, Fig. 13).

Tokens are decoded one at a time; at each layer the token's k experts must be in the buffer (a miss
is a demand read from flash that stalls compute). With preloading, while layer l computes the
predictor's top-n experts for layer l+1 are read ahead (layer 0 of the next token uses the
frequency table). The policies themselves live in `edgeprobe_kernels.expert_cache`, shared with
the device agent.
"""
from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from edgeprobe_kernels.expert_cache import POLICIES, ExpertCache

from .experts import PreloadPredictor, RoutingTrace


def preload_plan(trace: RoutingTrace, predictor: PreloadPredictor, n: int) -> np.ndarray:
    """int64[tokens, L, n]: experts to read ahead for each (token, layer), decided one layer earlier."""
    ex = np.asarray(trace.experts, np.int64)
    T, L, _ = ex.shape
    t1 = ex[:, :, 0]
    plan = np.empty((T, L, n), np.int64)
    plan[:, 0] = predictor.predict(0, None, None, n)[0]
    for l in range(1, L):
        plan[:, l] = predictor.predict(l, t1[:, l - 1], t1[:, l - 2] if l >= 2 else None, n)
    return plan


def simulate(trace: RoutingTrace, policy: str, capacity: int, freq: np.ndarray | None = None,
             plan: np.ndarray | None = None, expert_bytes: int = 1) -> dict:
    """Replay `trace` through one buffer. plan: preload_plan(...) or None for no preloading.

    Returns hit_rate (uses found in the buffer), demand_reads and preload_reads per token,
    bytes_per_token (all reads from flash), preload_precision (preloads later used).
    """
    ex = np.asarray(trace.experts, np.int64)
    T, L, k = ex.shape
    cache = ExpertCache(capacity, policy, freq, L)
    for t in range(T):
        for l in range(L):
            need = [(l, int(e)) for e in ex[t, l]]
            pinned = set(need)
            for key in need:
                cache.access(key, l, pinned)
            if plan is not None:  # read ahead for the next layer (or the next token's first) while l computes
                nl, nt = (l + 1, t) if l + 1 < L else (0, t + 1)
                if nt < T:
                    for e in plan[nt, nl]:
                        cache.preload((nl, int(e)), l, pinned)
    uses = cache.hits + cache.misses
    return {"policy": policy, "capacity": capacity, "preload": plan is not None,
            "preload_n": 0 if plan is None else plan.shape[2], "buffer_bytes": capacity * expert_bytes,
            "hit_rate": cache.hits / max(uses, 1), "demand_reads_per_token": cache.misses / T,
            "preload_reads_per_token": cache.preloads / T,
            "bytes_per_token": (cache.misses + cache.preloads) * expert_bytes / T,
            "preload_precision": cache.useful_preloads / cache.preloads if cache.preloads else None}


def sweep(trace: RoutingTrace, capacities, freq: np.ndarray, predictor: PreloadPredictor | None = None,
          policies=POLICIES, preload_n: int | None = None, expert_bytes: int = 1, progress: bool = True) -> list[dict]:
    """Every policy x capacity, without and (given a predictor) with preloading: rows for Fig. 13."""
    plan = None
    if predictor is not None:
        plan = preload_plan(trace, predictor, preload_n or trace.k)
    runs = [(p, c, pl) for p in policies for c in capacities for pl in ([None, plan] if plan is not None else [None])]
    return [simulate(trace, p, int(c), freq, pl, expert_bytes)
            for p, c, pl in tqdm(runs, desc="cache policies", disable=not progress, leave=False)]
