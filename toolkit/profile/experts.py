"""Expert routing of MoE models: routing traces, co-activation statistics, a preload predictor (EdgeMoE).

EdgeMoE (PAPERS.md §3) rests on three measured facts: experts are used about evenly one by one
(§2.2), activation paths across layers follow a power law (Fig. 4), and the experts of consecutive
layers are strongly correlated, so P(E_n | E_n-1, E_n-2) predicts which experts to preload (§3.3,
Fig. 8). `CoActivationStats` measures all three in one streaming pass over a corpus.

Conventions: a token's *path* is its top-1 expert (largest gate weight) at each layer, as in the
top-1 Switch Transformers EdgeMoE profiles; conditional tables condition on the top-1 experts of the
previous layers and predict membership in the next layer's chosen set of k experts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from edgeprobe_kernels import names as N

from ..errors import UnsupportedModelError
from ..models import Model
from .base import Profile
from .store import load_npz, save_npz

MAX_PATH_STATES = 1 << 22  # dense path histogram up to 4M possible paths (32 MB of int64)


def require_moe(model: Model, what: str = "the experts profiler") -> None:
    c = model.config
    if not c.n_experts:
        raise UnsupportedModelError(f"model {model.name or c.name!r} is dense (no experts); {what} needs a "
                                    "mixture-of-experts model such as the built-in 'tiny-moe'")


@dataclass
class RoutingTrace:
    """The experts each token was routed to: experts int16[tokens, layers, k] (best first) and their
    gate weights float32[tokens, layers, k]; `starts` int64[windows] are the first token of each sequence."""

    experts: np.ndarray
    weights: np.ndarray
    starts: np.ndarray
    n_experts: int
    model_name: str = ""

    KIND: ClassVar[str] = "routing-trace"

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def n_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def k(self) -> int:
        return self.experts.shape[2]

    def slice(self, a: int, b: int) -> "RoutingTrace":
        st = self.starts[(self.starts >= a) & (self.starts < b)] - a
        return RoutingTrace(self.experts[a:b], self.weights[a:b], st, self.n_experts, self.model_name)

    def save(self, path):
        return save_npz(path, {"kind": self.KIND, "n_experts": self.n_experts, "model": self.model_name},
                        {"trace": {"experts": self.experts, "weights": self.weights, "starts": self.starts}})

    @classmethod
    def load(cls, path) -> "RoutingTrace":
        meta, arrays = load_npz(path, cls.KIND)
        t = arrays["trace"]
        return cls(t["experts"], t["weights"], t["starts"], int(meta["n_experts"]), meta.get("model", ""))


class _RoutingRecorder:
    """Forward-pass hooks that collect one window's routing, layer by layer."""

    def __init__(self, model: Model):
        require_moe(model)
        self.L = model.config.n_layers
        self._exp: list = [None] * self.L
        self._w: list = [None] * self.L
        self._ent = np.zeros(self.L)

    def hooks(self) -> dict:
        def observe(name, x):
            layer = N.layer_of(name)
            self._exp[layer], self._w[layer] = x.experts.astype(np.int16), x.weights
            z = x - x.max(axis=1, keepdims=True)
            p = np.exp(z)
            p /= p.sum(axis=1, keepdims=True)
            self._ent[layer] += float(-(p * np.log2(np.maximum(p, 1e-30))).sum())
        return {N.blk(i, N.ROUTER_HOOK): observe for i in range(self.L)}

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's experts int16[N, L, k] and weights float32[N, L, k]."""
        if any(e is None for e in self._exp):
            raise RuntimeError("the router hook did not fire on every layer")
        ex, w = np.stack(self._exp, axis=1), np.stack(self._w, axis=1)
        self._exp, self._w = [None] * self.L, [None] * self.L
        return ex, w


def record_routing(model: Model, ids, window: int = 256, max_tokens: int | None = None,
                   progress: bool = True) -> RoutingTrace:
    """Run `ids` window by window (each an independent sequence) and keep every token's routing."""
    from tqdm.auto import tqdm

    from edgeprobe_kernels.threads import host_pass

    from ..forward import forward
    from .runner import windows

    rec = _RoutingRecorder(model)
    hooks = rec.hooks()
    exps, ws = [], []
    with host_pass() as threads:  # the cores other processes leave free, per window
        for chunk in tqdm(windows(ids, window, max_tokens), desc="routing", unit="win", disable=not progress,
                          leave=False):
            threads.tick()
            forward(model, chunk, hooks=hooks, logits="none")
            e, w = rec.take()
            exps.append(e)
            ws.append(w)
    starts = np.cumsum([0] + [len(e) for e in exps[:-1]]).astype(np.int64)
    return RoutingTrace(np.concatenate(exps), np.concatenate(ws), starts, model.config.n_experts, model.name)


class CoActivationStats(Profile):
    """Streaming routing statistics of an MoE model (EdgeMoE §2.2, §3.3).

    Fields per layer l (all counts, merged by sum), E experts, k chosen per token:
      freq  int64[L, E]        tokens routed to expert i (i among the k chosen)
      top1  int64[L, E]        tokens whose top-1 expert is i
      c1    int64[L, E, E]     c1[l, a, i]: top-1 at l-1 is a and i is chosen at l
      n2    int64[L, E, E]     n2[l, b, a]: top-1 at l-2 is b and at l-1 is a
      c2    int64[L, E, E, E]  c2[l, b, a, i]: that context, and i chosen at l
      paths int64[E^P]         tokens per top-1 path over the first P layers (P = params["path_layers"])
      entropy float64[L]       summed router entropy in bits (softmax over all E experts)
    """

    KIND: ClassVar[str] = "coactivation"
    FIELDS: ClassVar[dict] = {}

    @classmethod
    def for_model(cls, model: Model) -> "CoActivationStats":
        require_moe(model)
        c = model.config
        P = min(c.n_layers, int(math.log(MAX_PATH_STATES) // math.log(max(c.n_experts, 2))))
        params = {"n_layers": c.n_layers, "n_experts": c.n_experts, "k": c.n_experts_used, "path_layers": P}
        st = cls(model_name=model.name, model_sha256=model.sha256, params=params)
        st.arrays = {"routing": st._zeros()}
        return st

    def empty(self) -> "CoActivationStats":
        st = super().empty()
        st.arrays = {"routing": st._zeros()}  # update() adds into these
        return st

    def _zeros(self) -> dict:
        L, E, P = self.L, self.E, self.params["path_layers"]
        z = lambda *s: np.zeros(s, np.int64)
        return {"freq": z(L, E), "top1": z(L, E), "c1": z(L, E, E), "n2": z(L, E, E), "c2": z(L, E, E, E),
                "paths": z(E ** P), "entropy": np.zeros(L)}

    @property
    def L(self) -> int:
        return int(self.params["n_layers"])

    @property
    def E(self) -> int:
        return int(self.params["n_experts"])

    @property
    def a(self) -> dict:
        return self.arrays["routing"]

    # ---- streaming ------------------------------------------------------------------------------
    def hooks(self, model: Model) -> dict:
        self._check_model(model)
        self._rec, self._slots = _RoutingRecorder(model), []
        return self._rec.hooks()

    def begin_window(self, ids) -> None:
        super().begin_window(ids)
        L = self.L  # the window's routing, filled in place by the recorder's hooks while it is the current slot
        self._slots.append(([None] * L, [None] * L, np.zeros(L)))
        self.at_window(len(self._slots) - 1)

    def at_window(self, w: int) -> None:
        self._rec._exp, self._rec._w, self._rec._ent = self._slots[w]

    def end_window(self, n_tokens: int) -> None:
        self._rec._exp, self._rec._w, self._rec._ent = self._slots.pop(0)  # windows end in the order they began
        ex, _ = self._rec.take()
        self.a["entropy"] += self._rec._ent
        self._rec._ent = np.zeros(self.L)
        self.update(ex)
        super().end_window(n_tokens)

    def update(self, experts: np.ndarray) -> None:
        """Count one batch of routing decisions: experts int[N, L, k] (best first)."""
        ex = np.asarray(experts, np.int64)
        N, L, _ = ex.shape
        if L != self.L or ex.max(initial=0) >= self.E:
            raise ValueError(f"routing of shape {ex.shape} does not fit a {self.L}-layer, {self.E}-expert model")
        E, a = self.E, self.a
        t1 = ex[:, :, 0]
        chosen = np.zeros((N, L, E), np.int64)
        np.put_along_axis(chosen, ex, 1, axis=2)
        for l in range(L):
            a["freq"][l] += chosen[:, l].sum(0)
            a["top1"][l] += np.bincount(t1[:, l], minlength=E)
            if l >= 1:
                a["c1"][l] += np.eye(E, dtype=np.int64)[t1[:, l - 1]].T @ chosen[:, l]
            if l >= 2:
                ctx = t1[:, l - 2] * E + t1[:, l - 1]
                a["n2"][l] += np.bincount(ctx, minlength=E * E).reshape(E, E)
                a["c2"][l] += (np.eye(E * E, dtype=np.int64)[ctx].T @ chosen[:, l]).reshape(E, E, E)
        P = self.params["path_layers"]
        code = np.zeros(N, np.int64)
        for l in range(P):
            code = code * E + t1[:, l]
        a["paths"] += np.bincount(code, minlength=E ** P)

    def add_trace(self, trace: RoutingTrace) -> "CoActivationStats":
        """Count a recorded RoutingTrace (equivalent to streaming the same tokens)."""
        self.update(trace.experts)
        self.tokens += trace.tokens
        self.windows += len(trace.starts)
        return self

    # ---- values ---------------------------------------------------------------------------------
    def expert_frequency(self) -> np.ndarray:
        """float64[L, E]: share of tokens that use expert i at layer l (rows sum to k)."""
        return self.a["freq"] / max(self.tokens, 1)

    def load_balance(self) -> dict[str, np.ndarray]:
        """Per layer: max load / mean load (1 = perfectly even), load entropy in bits (log2 E = even),
        mean router entropy in bits (how decided each token's routing is)."""
        f = self.a["freq"] / np.maximum(self.a["freq"].sum(1, keepdims=True), 1)
        return {"max_over_mean": f.max(1) * self.E,
                "load_entropy_bits": -(f * np.log2(np.maximum(f, 1e-30))).sum(1),
                "router_entropy_bits": self.a["entropy"] / max(self.tokens, 1)}

    def path_counts(self) -> np.ndarray:
        """int64[observed paths]: tokens per distinct top-1 path, most frequent first."""
        p = self.a["paths"]
        return np.sort(p[p > 0])[::-1]

    def path_coverage(self, top_share: float = 0.2) -> float:
        """Share of tokens whose path is among the top `top_share` of observed paths (EdgeMoE Fig. 4)."""
        c = self.path_counts()
        if len(c) == 0:
            return 0.0
        n = max(1, int(math.ceil(top_share * len(c))))
        return float(c[:n].sum() / c.sum())

    def power_law(self) -> dict:
        """Fit count ∝ rank^-alpha over the paths seen at least twice (singletons make a flat tail).

        Returns alpha, r2 (of the log-log fit), the paths fitted, observed and possible.
        """
        c = self.path_counts()
        fit = c[c >= 2]
        out = {"paths_observed": int(len(c)), "paths_possible": int(self.E ** self.params["path_layers"]),
               "paths_fitted": int(len(fit)), "alpha": float("nan"), "r2": float("nan"), "log10_c": float("nan")}
        if len(fit) >= 3:
            x, y = np.log10(np.arange(1, len(fit) + 1)), np.log10(fit)
            slope, icpt = np.polyfit(x, y, 1)
            resid = y - (slope * x + icpt)
            out.update(alpha=float(-slope), log10_c=float(icpt),
                       r2=float(1 - (resid ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30)))
        return out

    def conditional(self, layer: int, order: int = 1) -> np.ndarray:
        """P(expert i chosen at `layer` | top-1 expert(s) of the previous layer(s)).

        order 1 -> float64[E(a), E(i)]; order 2 -> float64[E(b), E(a), E(i)] with b at layer-2.
        Rows of unseen contexts are NaN.
        """
        if order not in (1, 2) or layer < order or layer >= self.L:
            raise ValueError(f"order {order} needs layer in [{order}, {self.L - 1}], got {layer}")
        with np.errstate(invalid="ignore", divide="ignore"):
            if order == 1:
                return self.a["c1"][layer] / self.a["top1"][layer - 1][:, None]
            return self.a["c2"][layer] / self.a["n2"][layer][:, :, None]

    def conditional_peak(self, order: int = 2) -> np.ndarray:
        """float64[L]: token-weighted mean of max_i P(i | context) per layer (Fig. 8's "87%"), NaN below `order`."""
        out = np.full(self.L, np.nan)
        for l in range(order, self.L):
            p = self.conditional(l, order)
            n = self.a["top1"][l - 1] if order == 1 else self.a["n2"][l]
            peak = np.nan_to_num(np.nanmax(np.where(np.isnan(p), -1, p), axis=-1), nan=0.0)
            out[l] = float((peak * n).sum() / max(n.sum(), 1))
        return out

    def predictor(self, order: int = 2, min_count: int = 3) -> "PreloadPredictor":
        return PreloadPredictor.from_stats(self, order, min_count)

    def summary(self, heldout: RoutingTrace | None = None) -> dict:
        lb = self.load_balance()
        pl = self.power_law()
        out = {"kind": self.KIND, "model": self.model_name, "tokens": self.tokens, "windows": self.windows,
               **{k: v for k, v in self.params.items()},
               "expert_frequency": self.expert_frequency().round(4).tolist(),
               "load_max_over_mean": lb["max_over_mean"].round(3).tolist(),
               "load_entropy_bits": lb["load_entropy_bits"].round(3).tolist(),
               "router_entropy_bits": lb["router_entropy_bits"].round(3).tolist(),
               "path_power_law": pl,
               "top20pct_paths_token_share": self.path_coverage(0.2),
               "conditional_peak_order1": _nan_list(self.conditional_peak(1)),
               "conditional_peak_order2": _nan_list(self.conditional_peak(2))}
        if heldout is not None:
            out["predictor_hit_rate"] = {f"order{o}": {f"top{n}": self.predictor(o).hit_rate(heldout, n)["mean"]
                                                       for n in (1, 2, 3, 4)} for o in (0, 1, 2)}
            out["predictor_heldout_tokens"] = heldout.tokens
        return out

    def figure(self, kind: str = "frequency", **kw):
        from .expert_figures import coactivation_figure

        return coactivation_figure(self, kind, **kw)


def _nan_list(a: np.ndarray) -> list:
    return [None if np.isnan(v) else round(float(v), 4) for v in a]


@dataclass
class PreloadPredictor:
    """Which experts will the next layer use? EdgeMoE §3.3's offline table, looked up online.

    probs[l]: order 0 float64[E] (expert frequency), order 1 [E, E] (by the previous layer's top-1),
    order 2 [E, E, E] (by the top-1 of the two previous layers). Contexts seen fewer than `min_count`
    times back off to the next lower order.
    """

    order: int
    p0: np.ndarray        # float64[L, E]
    p1: np.ndarray        # float64[L, E, E]
    p2: np.ndarray        # float64[L, E, E, E]
    n1: np.ndarray        # int64[L, E]     context counts for order 1
    n2: np.ndarray        # int64[L, E, E]  context counts for order 2
    min_count: int = 3

    @classmethod
    def from_stats(cls, st: CoActivationStats, order: int = 2, min_count: int = 3) -> "PreloadPredictor":
        if order not in (0, 1, 2):
            raise ValueError(f"predictor order must be 0, 1 or 2, got {order}")
        a, L, E = st.a, st.L, st.E
        p0 = a["freq"] / np.maximum(a["freq"].sum(1, keepdims=True), 1)
        n1 = np.zeros((L, E), np.int64)
        n1[1:] = a["top1"][:-1]
        with np.errstate(invalid="ignore", divide="ignore"):
            p1 = np.nan_to_num(a["c1"] / n1[:, :, None])
            p2 = np.nan_to_num(a["c2"] / a["n2"][:, :, :, None])
        return cls(order, p0, p1, p2, n1, a["n2"].copy(), min_count)

    def scores(self, layer: int, prev1=None, prev2=None) -> np.ndarray:
        """float64[N, E] scores for `layer` given top-1 experts int[N] at layer-1 (prev1) and layer-2 (prev2)."""
        from edgeprobe_kernels.expert_cache import preload_scores

        return preload_scores(self.to_arrays(), layer, prev1, prev2)

    def predict(self, layer: int, prev1=None, prev2=None, n: int = 2) -> np.ndarray:
        """int64[N, n]: the n experts to preload for `layer`, most likely first."""
        s = self.scores(layer, prev1, prev2)
        return np.argsort(-s, axis=1, kind="stable")[:, :n]

    def hit_rate(self, trace: RoutingTrace, n: int = 2) -> dict:
        """Share of the experts actually chosen at layers 1..L-1 that were among the n predicted
        (preloaded while the previous layer computed). Returns per-layer rates and their mean."""
        ex = np.asarray(trace.experts, np.int64)
        t1 = ex[:, :, 0]
        per = []
        for l in range(1, ex.shape[1]):
            pred = self.predict(l, t1[:, l - 1], t1[:, l - 2] if l >= 2 else None, n)
            hit = (pred[:, :, None] == ex[:, l][:, None, :]).any(axis=1)  # [N, k]
            per.append(float(hit.mean()))
        return {"per_layer": per, "mean": float(np.mean(per)) if per else float("nan"),
                "n": n, "order": self.order, "random": min(n, self.p0.shape[1]) / self.p0.shape[1]}

    def to_arrays(self) -> dict:
        """Plain arrays (for the device agent, which must not import edgeprobe)."""
        return {"order": np.int64(self.order), "min_count": np.int64(self.min_count), "p0": self.p0,
                "p1": self.p1, "p2": self.p2, "n1": self.n1, "n2": self.n2}

