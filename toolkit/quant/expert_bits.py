"""Per-expert bit widths (EdgeMoE §3.2): INT2 sensitivity per expert, width selection under a
tolerated loss P, and the model-size / loss curve as P varies (Fig. 7a, Fig. 15).

Every configuration is evaluated the way `moe-mixed` runs it: experts per-channel INT2/4/8
(`edgeprobe_kernels.intn`), every other linear per-channel INT8, routers, embeddings and norms float.
Loss is the mean next-token NLL (nats) over fixed windows; P is a tolerated relative increase of
perplexity over the float model, i.e. loss <= float_loss + ln(1 + P).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from edgeprobe_kernels.intn import dequantize_channels, packed_bytes, quantize_channels

from ..evaluate import window_nll
from ..forward import forward, is_router, linear_names, linear_tensor
from ..models import Model
from ..profile.experts import require_moe
from ..profile.runner import windows

_OPS = ("gate", "up", "down")


def expert_nbytes(config, bits: int) -> int:
    """Bytes of one expert (three linears) at `bits` per-channel: packed codes plus float16 row scales."""
    f, h = config.expert_ffn, config.hidden
    return 2 * (packed_bytes(f, h, bits) + 2 * f) + packed_bytes(h, f, bits) + 2 * h


def expert_linears(layer: int, expert: int) -> list[str]:
    return [f"blk.{layer}.ffn_{op}_exps.{expert}" for op in _OPS]


@dataclass
class Selection:
    """One choice of widths: K least sensitive experts at `low` bits, the rest at `high` bits."""

    tolerance: float
    low: int
    high: int
    k_low: int
    loss: float
    perplexity_increase: float  # relative, vs float
    model_bytes: int
    expert_bytes: int
    bits: dict = field(repr=False)  # expert linear name -> bits (what quantize(..., expert_bits=) takes)
    reachable: bool = True

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "bits"}
        d["experts_by_bits"] = {b: sum(1 for n, v in self.bits.items() if v == b and n.startswith("blk.")
                                       and n.split(".")[2].startswith("ffn_gate")) for b in (2, 4, 8)}
        return d


class ExpertBitsStudy:
    """Evaluate per-expert width choices of an MoE model on fixed token windows.

    ids: int[tokens] of a calibration text (not the evaluation text); window / max_windows pick the
    windows every configuration is scored on.
    """

    def __init__(self, model: Model, ids, window: int = 256, max_windows: int | None = 8, progress: bool = True):
        require_moe(model, "the per-expert bit-width study")
        self.model, self.progress = model, progress
        c = model.config
        self.L, self.E = c.n_layers, c.n_experts
        chunks = windows(ids, window)
        self.chunks = chunks[:max_windows] if max_windows else chunks
        self.tokens = sum(len(x) - 1 for x in self.chunks)
        self._deq: dict[tuple[str, int], np.ndarray] = {}
        self._cache: dict[tuple, float] = {}
        names = linear_names(c)
        self.expert_names = [n for n in names if "_exps." in n]
        self.other_names = [n for n in names if "_exps." not in n]
        self._other = {n: model.linear_weight(n) if is_router(n) else self._dequant(n, 8) for n in self.other_names}
        self.float_loss = self._loss(None)
        self.uniform = {b: self.loss({}, default=b) for b in (2, 4, 8)}
        self.sensitivity: np.ndarray | None = None

    # ---- evaluation ----------------------------------------------------------------------------
    def _dequant(self, name: str, bits: int) -> np.ndarray:
        key = (name, bits)
        if key not in self._deq:
            w = np.asarray(self.model.linear_weight(name), np.float32)
            codes, scales = quantize_channels(w, bits)
            self._deq[key] = dequantize_channels(codes, scales, bits, w.shape[1])
        return self._deq[key]

    def _loss(self, weights: dict | None) -> float:
        linear = None if weights is None else (lambda name, x: x @ weights[name].T)
        nll = sum(float(window_nll(forward(self.model, ch, linear=linear), ch).sum()) for ch in self.chunks)
        return nll / self.tokens

    def loss(self, bits: dict, default: int = 4) -> float:
        """Mean NLL with experts at bits.get((layer, expert), default) and other linears at INT8."""
        key = (default, tuple(sorted((k, v) for k, v in bits.items() if v != default)))
        if key not in self._cache:
            w = dict(self._other)
            for l in range(self.L):
                for e in range(self.E):
                    b = bits.get((l, e), default)
                    for n in expert_linears(l, e):
                        w[n] = self._dequant(n, b)
            self._cache[key] = self._loss(w)
        return self._cache[key]

    @property
    def evaluations(self) -> int:
        return len(self._cache) + 1

    # ---- Fig. 7a ---------------------------------------------------------------------------------
    def measure_sensitivity(self, low: int = 2, base: int = 4) -> np.ndarray:
        """float64[L, E]: loss change when that one expert is at `low` bits and all others at `base`."""
        ref = self.loss({}, default=base)
        s = np.zeros((self.L, self.E))
        pairs = [(l, e) for l in range(self.L) for e in range(self.E)]
        for l, e in tqdm(pairs, desc="INT2 sensitivity", unit="expert", disable=not self.progress, leave=False):
            s[l, e] = self.loss({(l, e): low}, default=base) - ref
        self.sensitivity = s
        return s

    def ranking(self) -> list[tuple[int, int]]:
        """Experts from least to most sensitive (EdgeMoE's importance list, reversed)."""
        if self.sensitivity is None:
            self.measure_sensitivity()
        order = np.argsort(self.sensitivity, axis=None, kind="stable")
        return [divmod(int(i), self.E) for i in order]

    # ---- sizes -----------------------------------------------------------------------------------
    def expert_nbytes(self, bits: int) -> int:
        return expert_nbytes(self.model.config, bits)

    def other_nbytes(self) -> int:
        """Everything but the experts: INT8 linears (+ scales), float routers, embeddings and norms."""
        total = 0
        for n in self.other_names:
            w = self.model.linear_weight(n)
            total += w.nbytes if is_router(n) else w.size + 2 * w.shape[0]
        linear_tensors = {linear_tensor(n) for n in linear_names(self.model.config)}
        total += sum(self.model.weights[n].nbytes for n in self.model.weights if n not in linear_tensors)
        return total

    # ---- §3.2 selection --------------------------------------------------------------------------
    def select(self, tolerance: float) -> Selection:
        """EdgeMoE's two steps: bound the width by uniform runs, then lower the K least important
        experts to the lower bound, K as large as the tolerance allows (binary search over K, which
        assumes loss grows with K, instead of the paper's one-by-one steps)."""
        if not tolerance >= 0:
            raise ValueError(f"tolerated loss P must be >= 0 (a relative perplexity increase), got {tolerance!r}")
        target = self.float_loss + math.log1p(tolerance)
        u = self.uniform
        if u[2] <= target:
            low, high, k = 2, 2, self.L * self.E
        elif u[4] <= target:
            low, high = 2, 4
        elif u[8] <= target:
            low, high = 4, 8
        else:
            low = high = 8
            k = 0
        if low != high:
            order = self.ranking()
            lo_k, hi_k = 0, len(order)  # loss(lo_k) <= target < loss(hi_k)
            while hi_k - lo_k > 1:
                mid = (lo_k + hi_k) // 2
                if self.loss({le: low for le in order[:mid]}, default=high) <= target:
                    lo_k = mid
                else:
                    hi_k = mid
            k = lo_k
            chosen = {le: low for le in self.ranking()[:k]}
        else:
            chosen = {}
        loss = self.loss(chosen, default=high)
        bits = {n: chosen.get((l, e), high) for l in range(self.L) for e in range(self.E) for n in expert_linears(l, e)}
        eb = sum(self.expert_nbytes(chosen.get((l, e), high)) for l in range(self.L) for e in range(self.E))
        return Selection(tolerance=tolerance, low=low, high=high, k_low=k, loss=loss,
                         perplexity_increase=math.expm1(loss - self.float_loss), model_bytes=eb + self.other_nbytes(),
                         expert_bytes=eb, bits=bits, reachable=loss <= target)

    def curve(self, tolerances=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5)) -> list[Selection]:
        """Fig. 15: model bytes and loss of the selection at each tolerated loss P."""
        return [self.select(p) for p in tqdm(tolerances, desc="tolerances", disable=not self.progress, leave=False)]

    def summary(self) -> dict:
        return {"tokens": self.tokens, "float_loss": self.float_loss,
                "uniform_loss": {f"int{b}": v for b, v in self.uniform.items()},
                "sensitivity": None if self.sensitivity is None else self.sensitivity.round(5).tolist(),
                "expert_bytes": {f"int{b}": self.expert_nbytes(b) for b in (2, 4, 8)},
                "other_bytes": self.other_nbytes(), "evaluations": self.evaluations}

    def figure(self, kind: str = "sensitivity", selections=None):
        from ..profile.expert_figures import bits_figure

        return bits_figure(self, kind, selections)
