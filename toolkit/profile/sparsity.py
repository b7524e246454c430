"""SparsityStats: how sparse the FFNs are and what that saves when neurons live on flash.

LLM in a flash (§2-3), DejaVu, PowerInfer. Observed at `blk.{i}.ffn_act`, the down-projection input
a = silu(gate(x)) * up(x) (float32[tokens, ffn]).

Inactive neurons. ReLU models: exact zeros. SiLU/GELU models (SmolLM2): neuron j is inactive for a
token when |a_j| <= tau_i, with tau_i per layer calibrated (`calibrate_thresholds`) as the largest
threshold for which dropping the inactive neurons changes the FFN output down(a) by at most eps
(default 1%) in relative L2 over the calibration tokens: ||W_down (a * [|a| <= tau])|| <= eps ||W_down a||.
The achieved error is measured again on the profiled tokens (every `error_stride`-th token).

Sliding window (LLM in a flash §3.2): with the neurons active in the last k tokens kept in DRAM,
per token: neurons resident, neurons newly loaded, and the bytes read from flash for them — each
neuron is a gate row, an up row and a down column (3 * hidden weights). Row-column bundling stores
the three together: the same bytes in one read instead of three.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from edgeprobe_kernels import names as N
from edgeprobe_kernels.activation_stats import pack_active, window_counts
from edgeprobe_kernels.threads import host_pass

from ..forward import forward
from ..models import Model
from .base import Profile
from .runner import windows

MAX_WINDOW = 16


def sq_norm(m: np.ndarray) -> float:
    """Squared Frobenius norm, summed in float64."""
    return float(np.einsum("ij,ij->", m, m, dtype=np.float64))


def dropped_output(a: np.ndarray, dropped: np.ndarray, wd: np.ndarray) -> np.ndarray:
    """The part of the FFN output down(a) that dropping neurons removes: (a * dropped) @ W_down^T.

    a: float32[N, ffn], dropped: bool[N, ffn], wd: float32[hidden, ffn] -> float32[N, hidden].
    """
    return np.where(dropped, a, 0.0).astype(np.float32) @ wd.T


@host_pass()  # the cores other processes leave free (edgeprobe_kernels.threads)
def calibrate_thresholds(model: Model, ids, eps: float = 0.01, tokens: int = 512, act_fn: str | None = None,
                         iters: int = 18) -> dict[int, float]:
    """Per-layer magnitude thresholds tau_i (see module doc) on the first `tokens` of `ids`.

    Bisection on log(tau) with the exact FFN output error on those tokens. ReLU models get tau = 0.
    """
    if not 0 < eps < 1:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    act_fn = act_fn or model.config.act_fn
    L = model.config.n_layers
    if act_fn == "relu":
        return {i: 0.0 for i in range(L)}
    chunk = windows(ids, max(2, min(tokens, len(ids))))[0]
    acts = {}
    keep = lambda n, x: acts.__setitem__(n, x.copy())
    forward(model, chunk, hooks={N.blk(i, N.FFN_ACT_HOOK): keep for i in range(L)}, logits="none")
    taus = {}
    for i in range(L):
        a = acts[N.blk(i, N.FFN_ACT_HOOK)]
        wd = model.weights[f"blk.{i}.ffn_down.weight"]
        y2 = sq_norm(a @ wd.T)
        lo, hi = np.log(max(np.abs(a).min(), 1e-12)), np.log(np.abs(a).max())
        for _ in range(iters):  # largest tau with error <= eps
            mid = 0.5 * (lo + hi)
            if np.sqrt(sq_norm(dropped_output(a, np.abs(a) <= np.exp(mid), wd)) / y2) <= eps:
                lo = mid
            else:
                hi = mid
        taus[i] = float(np.exp(lo))
    return taus


class SparsityStats(Profile):
    """Per-layer FFN activation sparsity, neuron frequencies and sliding-window traffic."""

    KIND: ClassVar[str] = "sparsity"
    # fire int64[ffn] firings per neuron; new / resident int64[K]: summed over tokens, neurons loaded /
    # held for windows k = 1..K (see window_counts); err float64[2] = [sum ||dy||^2, sum ||y||^2] over
    # sampled tokens.
    FIELDS: ClassVar[dict] = {"fire": "sum", "new": "sum", "resident": "sum", "err": "sum"}

    @classmethod
    def for_model(cls, model: Model, thresholds: dict[int, float], eps: float = 0.01, act_fn: str | None = None,
                  max_window: int = MAX_WINDOW, error_stride: int = 16) -> "SparsityStats":
        L = model.config.n_layers
        if sorted(int(k) for k in thresholds) != list(range(L)):
            raise ValueError(f"thresholds must give one tau per layer 0..{L - 1}; use calibrate_thresholds")
        params = {"thresholds": [float(thresholds[i] if i in thresholds else thresholds[str(i)]) for i in range(L)],
                  "eps": float(eps), "act_fn": act_fn or model.config.act_fn, "max_window": int(max_window),
                  "error_stride": int(error_stride), "hidden": model.config.hidden, "ffn": model.config.ffn}
        return cls(model_name=model.name, model_sha256=model.sha256, params=params)

    def hooks(self, model: Model) -> dict:
        self._check_model(model)
        K, stride, taus = self.params["max_window"], self.params["error_stride"], self.params["thresholds"]
        self._carry, self._carries = {}, []

        def observe(name, a):
            i = N.layer_of(name)
            F = a.shape[1]
            st = self.arrays.get(name)
            if st is None:
                st = self.arrays[name] = {"fire": np.zeros(F, np.int64), "new": np.zeros(K, np.int64),
                                          "resident": np.zeros(K, np.int64), "err": np.zeros(2, np.float64)}
            on = pack_active(a, taus[i])
            bits = np.unpackbits(on.view(np.uint8), axis=1, bitorder="little", count=F)
            st["fire"] += bits.sum(axis=0, dtype=np.int64)
            carry = self._carry.get(name)
            if carry is None:
                carry = np.zeros((K, on.shape[1]), np.uint64)
            self._carry[name] = window_counts(on, carry, st["new"], st["resident"])
            s = a[::stride]
            wd = model.weights[f"blk.{i}.ffn_down.weight"]
            st["err"] += [sq_norm(dropped_output(s, np.abs(s) <= taus[i], wd)), sq_norm(s @ wd.T)]
        return {N.blk(i, N.FFN_ACT_HOOK): observe for i in range(model.config.n_layers)}

    def begin_window(self, ids):
        super().begin_window(ids)
        self._carry = {}  # each window is a new sequence: nothing resident
        self._carries.append(self._carry)  # a layer-major pass begins every window first: window w's is [w]

    def at_window(self, w: int) -> None:
        self._carry = self._carries[w]

    def end_window(self, n_tokens: int) -> None:
        super().end_window(n_tokens)
        self._carries = []  # every window's hooks have run (either order)

    # ---- derived ---------------------------------------------------------------------------------
    def _layer(self, i: int) -> dict:
        return self.arrays[N.blk(i, N.FFN_ACT_HOOK)]

    @property
    def n_layers(self) -> int:
        return len(self.params["thresholds"])

    def inactive_fraction(self) -> np.ndarray:
        """float64[layers]: fraction of (token, neuron) pairs below the layer's threshold."""
        F = self.params["ffn"]
        return np.array([1.0 - self._layer(i)["fire"].sum() / max(self.tokens * F, 1) for i in range(self.n_layers)])

    def achieved_error(self) -> np.ndarray:
        """float64[layers]: relative L2 change of the FFN output when inactive neurons are dropped."""
        errs = (self._layer(i)["err"] for i in range(self.n_layers))
        return np.array([np.sqrt(e[0] / e[1]) if e[1] else np.nan for e in errs])

    def frequency(self, i: int) -> np.ndarray:
        """float64[ffn]: fraction of tokens on which each neuron of layer i fires."""
        return self._layer(i)["fire"] / max(self.tokens, 1)

    def hot_fraction(self, share: float = 0.8) -> np.ndarray:
        """float64[layers]: % of neurons that account for `share` of the layer's firings (hot/cold)."""
        out = []
        for i in range(self.n_layers):
            f = np.sort(self._layer(i)["fire"])[::-1].astype(np.float64)
            cum = np.cumsum(f) / max(f.sum(), 1)
            out.append(100.0 * (int(np.searchsorted(cum, share - 1e-12)) + 1) / len(f))
        return np.array(out)

    def window(self, bits: float = 4.0) -> dict[str, np.ndarray]:
        """Sliding window k = 1..K, averaged over layers and tokens, per layer.

        resident[k-1]: neurons held in DRAM; new[k-1]: neurons loaded per token; bytes[k-1]: bytes read
        per token per layer at `bits` per weight; reads_bundled / reads_unbundled: flash reads per token
        per layer (1 or 3 per neuron), of bundle_bytes / row_bytes each.
        """
        K, h = self.params["max_window"], self.params["hidden"]
        denom = max(self.tokens * self.n_layers, 1)
        ks = np.arange(1, K + 1)
        resident = np.sum([self._layer(i)["resident"] for i in range(self.n_layers)], axis=0) / denom
        new = np.sum([self._layer(i)["new"] for i in range(self.n_layers)], axis=0) / denom
        row_bytes = h * bits / 8
        return {"k": ks, "resident": resident, "new": new, "bytes": new * 3 * row_bytes,
                "reads_bundled": new, "reads_unbundled": 3 * new,
                "bundle_bytes": np.full(K, 3 * row_bytes), "row_bytes": np.full(K, row_bytes)}

    def summary(self, bits: float = 4.0) -> dict:
        inact, err, w = self.inactive_fraction(), self.achieved_error(), self.window(bits)
        F, h = self.params["ffn"], self.params["hidden"]
        dense_bytes = 3 * h * F * bits / 8
        pick = {k: int(k) - 1 for k in (1, 4, 8, 16) if k <= self.params["max_window"]}
        return {
            "kind": self.KIND, "model": self.model_name, "tokens": self.tokens, "windows": self.windows,
            "eps": self.params["eps"], "act_fn": self.params["act_fn"],
            "inactive_fraction_mean": float(inact.mean()), "inactive_fraction_min": float(inact.min()),
            "inactive_fraction_max": float(inact.max()),
            "inactive_fraction_per_layer": [round(float(v), 4) for v in inact],
            "thresholds": [round(float(v), 5) for v in self.params["thresholds"]],
            "achieved_error_mean": float(np.nanmean(err)), "achieved_error_max": float(np.nanmax(err)),
            "hot_neurons_pct_for_80pct_mean": float(self.hot_fraction(0.8).mean()),
            "bits": bits,
            "window": {str(k): {"resident": round(float(w["resident"][j]), 1),
                                "new_per_token": round(float(w["new"][j]), 1),
                                "flash_bytes_per_token_per_layer": round(float(w["bytes"][j])),
                                "fraction_of_dense_ffn_bytes": round(float(w["bytes"][j] / dense_bytes), 4),
                                "reads_bundled": round(float(w["reads_bundled"][j]), 1),
                                "reads_unbundled": round(float(w["reads_unbundled"][j]), 1)}
                       for k, j in pick.items()},
            "bundle_bytes": float(w["bundle_bytes"][0]), "row_bytes": float(w["row_bytes"][0]),
        }

    def figure(self, kind: str = "inactive"):
        from . import figures

        return figures.sparsity_figure(self, kind)
