"""The op registry the executor runs: op kind -> fn(inputs, attrs, ctx) -> float32 array, plus its FLOPs.

Ops compute with `edgeprobe_kernels` (the same functions the host's forward pass and quantization
simulation use), so a plan run here matches the host. `ctx.get(sha)` reads a blob (resident or from
flash); `ctx.counters` collects kernel events (outliers, cold shadow rows read) of this run's lane alone:
cached runners are built without counters and get the calling run's at each call. Each op module registers
its ops here with `@op(kind)`; `ops/__init__.py` imports them all.
"""
from __future__ import annotations

import threading

import numpy as np

from ..protocol import AgentError

OPS: dict = {}  # op kind -> fn(inputs, attrs, ctx)

# op kind -> the input it gathers a few rows from: a blob there is mapped, not read whole (an embedding table is
# 113 MB float32 for SmolLM2, as large as the rest of the int8 model; a run reads only its tokens' rows' pages)
GATHERS_ROWS = {"embed": 1}


class OpError(AgentError):
    """An op that cannot run on its inputs or attrs."""


def op(kind: str):
    """Register the decorated fn as the op `kind` (one kind, one fn)."""
    def register(fn):
        if kind in OPS:
            raise ValueError(f"op kind {kind!r} is registered twice")
        OPS[kind] = fn
        return fn
    return register


def _arr(x, name: str, ndim: int | None = None) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise OpError("bad_input", f"{name} must be an array")
    if ndim is not None and x.ndim != ndim:
        raise OpError("bad_input", f"{name} must have {ndim} dimensions, got shape {x.shape}")
    return x


class RunnerCache:
    """Compiled linear runners (dequantized weights, float32 copies) kept across runs and shared by every
    run's lanes. One lock guards the dict; a runner is built outside it (builds read blobs), and when two
    lanes build the same one at once the first stored wins."""

    def __init__(self):
        self._fns: dict = {}
        self._keys: dict = {}  # id(rec) -> (rec, its key): the rec held, so its id is not reused while cached
        self._max_keys = 200_000  # each plan put brings new record objects: forget all past this (recomputed on use)
        self._lock = threading.Lock()

    def rec_key(self, rec: dict) -> tuple:
        """A manifest record's scalar fields as a hashable key, computed once per record object: a validated
        plan's records are never changed, and a decode step looks up ~200 of them."""
        with self._lock:
            hit = self._keys.get(id(rec))
        if hit is not None and hit[0] is rec:
            return hit[1]
        key = tuple(sorted((k, v) for k, v in rec.items() if isinstance(v, (str, int, float, bool))))
        self._remember(id(rec), rec, key)
        return key

    def per_object(self, obj, tag: str, make):
        """make(obj), computed once per (object, tag) and kept with the object (validated plans never change)."""
        with self._lock:
            hit = self._keys.get((id(obj), tag))
        if hit is not None and hit[0] is obj:
            return hit[1]
        val = make(obj)
        self._remember((id(obj), tag), obj, val)
        return val

    def _remember(self, key, obj, val) -> None:
        with self._lock:
            if len(self._keys) >= self._max_keys:
                self._keys.clear()
            self._keys[key] = (obj, val)

    def get(self, key, build):
        with self._lock:
            fn = self._fns.get(key)
        if fn is None:
            fn = build()
            with self._lock:
                fn = self._fns.setdefault(key, fn)
        return fn

    def __len__(self) -> int:
        with self._lock:
            return len(self._fns)


def flops(kind: str, inp, out, attrs, ctx=None) -> int:
    """Multiply-adds x2 of the op (0 for data movement; a fused op reports its sub-ops' sum itself)."""
    if kind == "fused":
        return 0
    if kind == "linear" and attrs.get("part") != "shadow":
        rows = attrs.get("rows")
        m = attrs.get("pad_to") or (rows[1] - rows[0] if rows else inp[0].shape[0])  # padded rows are computed too
        return 2 * m * inp[0].shape[1] * out.shape[1]
    if kind == "lm_head":
        return 2 * out.shape[0] * inp[0].shape[1] * out.shape[1]
    if kind == "ffn_flash":  # predictor + the active neurons' three products (counted from the output rows)
        return 2 * inp[0].shape[0] * inp[1].shape[1] * (inp[0].shape[1] + inp[2].shape[1])
    if kind == "attention":
        T, H, d = inp[0].shape[0], int(attrs["n_heads"]), int(attrs["head_dim"])
        S = sum(a.shape[0] for a in inp[1:1 + int(attrs.get("parts", 1))])
        if attrs.get("session") and ctx is not None and ctx.session is not None:  # all the session's keys
            return 4 * H * T * (S // int(attrs.get("batch", 1)) + ctx.session.length + ctx.offset) * d
        return 4 * H * T * S * d  # QK^T and PV over S keys (the causal mask still computes them)
    return int(out.size)


def bytes_in(args: list) -> int:
    """The bytes of an op's array inputs (its trace event's bytes_in)."""
    n = 0
    for a in args:
        if isinstance(a, np.ndarray):
            n += a.nbytes
    return n
