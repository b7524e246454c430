"""Experts streamed from flash (EdgeMoE §3.3): the `moe_ffn` op and the expert buffer of a decode session.

Non-expert weights stay resident; each expert's weights are read from the blob store when routed to. The
buffer keeps `capacity` experts under a policy of edgeprobe_kernels.expert_cache (fifo / lru / lfu /
edgemoe) — the same code the host simulator replays traces with. With preloading, once a layer has routed,
the predictor's top-n experts of the next layer are read on the session's I/O thread (the `io` lane of the
trace) while this layer computes; a routed expert still in flight is waited for, not read twice.
Every read is cold (FlashStore.read_rows drops the pages from the OS page cache). The buffer lives across
runs but reads through the calling run's reader (so each flash read is traced in the run that issued it),
and a run settles its preloads before it replies (so no read of a run lands after its reply).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from edgeprobe_kernels.expert_cache import ExpertCache, preload_scores
from edgeprobe_kernels.linear_records import RUNNERS, scheme_of, weight_blobs
from edgeprobe_kernels.llama_ops import mix_experts, route, swiglu_act

from .ops.registry import OpError, _arr

PROJ = ("gate", "up", "down")


def _blobs(recs: dict) -> list:
    return sorted(set().union(*(weight_blobs(r) for r in recs.values())))


class ExpertBuffer:
    """capacity 0: no buffer (every use reads the expert; preloads are staged until their layer runs)."""

    def __init__(self, capacity: int, policy: str, freq, n_layers: int):
        self.cache = ExpertCache(capacity, policy, freq, n_layers) if capacity else None
        self.arrays: dict = {}                 # key -> {sha: array} of resident (or staged) experts
        self.pending: dict = {}                # key -> Future of a preload
        self.io = ThreadPoolExecutor(1, thread_name_prefix="io-lane")
        self.stats = {"uses": 0, "hits": 0, "demand_reads": 0, "preload_reads": 0, "preload_used": 0}

    @staticmethod
    def _load(shas, read) -> dict:
        return {s: read(s) for s in shas}

    def need(self, key, shas, layer: int, pinned, read) -> dict:
        """read: sha -> array from flash, the calling run's (its reads are traced in that run)."""
        self.stats["uses"] += 1
        fut = self.pending.pop(key, None)
        if fut is not None:
            self.arrays[key] = fut.result()     # a preload in flight or done: wait, do not read twice
            self.stats["preload_used"] += 1
        if self.cache is None:
            got = self.arrays.pop(key, None)
            if got is not None:
                self.stats["hits"] += 1
                return got
            self.stats["demand_reads"] += 1
            return self._load(shas, read)
        hit = self.cache.access(key, layer, pinned) and key in self.arrays
        if hit:
            self.stats["hits"] += 1
        else:
            self.stats["demand_reads"] += 1
            self.arrays[key] = self._load(shas, read)
        got = self.arrays[key]
        for k in [k for k in self.arrays if k not in self.cache.slots]:  # evicted (or never kept)
            del self.arrays[k]
        return got

    def preload(self, key, shas, layer: int, pinned, read) -> None:
        if key in self.arrays or key in self.pending:
            return
        if self.cache is not None and not self.cache.preload(key, layer, pinned):
            return
        self.stats["preload_reads"] += 1
        self.pending[key] = self.io.submit(self._load, shas, read)

    def settle(self) -> None:
        """Wait for every preload in flight (a run calls this before its reply; the results stay pending)."""
        wait(list(self.pending.values()))

    def close(self):
        self.io.shutdown(wait=True)


def op_moe_ffn(inp, attrs, ctx):
    """inputs: x float32[T, hidden] (after ffn_norm), router weight float32[E, hidden].
    attrs: moe_layer, n_layers, k, norm_topk, experts [{gate, up, down: linear records}] (E of them),
    flash {capacity, policy, preload_n} or None (experts resident), predictor {order, min_count, p0, p1,
    p2, n1, n2: blob shas} (for preloading and the edgemoe policy)."""
    x, wr = _arr(inp[0], "x", 2), _arr(inp[1], "router", 2)
    layer, L, k = int(attrs["moe_layer"]), int(attrs["n_layers"]), int(attrs["k"])
    experts, flash = attrs["experts"], attrs.get("flash")
    ex, w = route(x @ wr.T, k, bool(attrs.get("norm_topk", True)))
    if flash is None:  # every expert resident: blobs through the store's memory
        get_expert = lambda e: {s: ctx.get(s) for s in _blobs(experts[e])}
        buf = None
    else:
        if ctx.session is None:
            raise OpError("no_session", "experts from flash keep their buffer in a decode session; run in one")
        st = ctx.session.extras.setdefault("experts", {})
        pred = attrs.get("predictor")
        tables = st.get("tables")
        if tables is None and pred:
            tables = st["tables"] = {n: (ctx.get(v) if isinstance(v, str) else v) for n, v in pred.items()}
        buf = st.get("buffer")
        if buf is None:
            freq = tables["p0"] if tables else None
            buf = st["buffer"] = ExpertBuffer(int(flash["capacity"]), flash.get("policy", "lru"), freq, L)
        before = dict(buf.stats)
        pinned = {(layer, int(e)) for e in np.unique(ex)}
        get_expert = lambda e: buf.need((layer, e), _blobs(experts[e]), layer, pinned, ctx.read_blob)
        # read ahead for the next layer (the next token's first layer after the last) while this one computes
        n_pre = int(flash.get("preload_n", 0))
        top1 = st.setdefault("top1", {})
        top1[layer] = ex[-1:, 0]
        if n_pre and tables:
            nl = (layer + 1) % L
            prev1 = top1.get(nl - 1) if nl >= 1 else None
            prev2 = top1.get(nl - 2) if nl >= 2 else None
            s = preload_scores(tables, nl, prev1, prev2)[-1]
            for e in np.argsort(-s, kind="stable")[:n_pre]:
                buf.preload((nl, int(e)), _blobs(attrs["next_experts"][int(e)]), layer, pinned, ctx.read_blob)
    def expert(e, xr):
        get = get_expert(e).__getitem__
        f = {p: RUNNERS[scheme_of(experts[e][p])](experts[e][p], get, ctx.counters) for p in PROJ}
        return f["down"](swiglu_act(f["gate"](xr), f["up"](xr)))
    y = mix_experts(x, ex, w, expert)
    if buf is not None:  # this op's share of the buffer's events, so a run's counters are its own
        for k_, v in buf.stats.items():
            ctx.counters[f"experts_{k_}"] = ctx.counters.get(f"experts_{k_}", 0) + v - before[k_]
    return y
