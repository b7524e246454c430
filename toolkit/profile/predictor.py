"""Low-rank predictors of the active FFN neurons (LLM in a flash §3.1, DejaVu §4).

Per layer i: p = sigmoid((x @ A) @ B + b) with x = ffn_in (float32[tokens, hidden]), A float32[hidden, r],
B float32[r, ffn]; neuron j is predicted active when p_j > cutoff_i. A, B start from the rank-r SVD of
W_gate (gate pre-activations are what decide SiLU's magnitude), then fit the profile's active sets
(|a| > tau_i) by full-batch Adam on binary cross-entropy, in numpy. cutoff_i is the largest that keeps
recall >= `target_recall` on the training tokens: a missed neuron costs accuracy, an extra one only bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from edgeprobe_kernels import names as N
from edgeprobe_kernels.threads import host_pass, tick

from ..forward import forward
from ..models import Model
from .runner import windows
from .sparsity import dropped_output, sq_norm


@dataclass
class PredictorReport:
    """Per-layer held-out quality: float64[layers] each. ffn_error: relative L2 error of the FFN output
    when only predicted neurons are computed (the rest read as zero)."""

    rank: int
    recall: np.ndarray
    precision: np.ndarray
    predicted_fraction: np.ndarray
    ffn_error: np.ndarray
    cutoffs: np.ndarray
    train_tokens: int
    test_tokens: int
    weights: dict = field(default_factory=dict, repr=False)  # layer -> (A, B, b)

    def summary(self) -> dict:
        return {"rank": self.rank, "train_tokens": self.train_tokens, "test_tokens": self.test_tokens,
                "recall_mean": float(self.recall.mean()), "precision_mean": float(self.precision.mean()),
                "predicted_fraction_mean": float(self.predicted_fraction.mean()),
                "ffn_error_mean": float(self.ffn_error.mean()), "ffn_error_max": float(self.ffn_error.max()),
                "recall_per_layer": [round(float(v), 4) for v in self.recall],
                "precision_per_layer": [round(float(v), 4) for v in self.precision]}

    def save(self, path) -> None:
        arrays = {f"{i}|{k}": v for i, (A, B, b) in self.weights.items() for k, v in (("A", A), ("B", B), ("b", b))}
        np.savez_compressed(path, cutoffs=self.cutoffs, **arrays)


def _collect(model: Model, ids, window: int, layers: range) -> tuple[dict, dict]:
    xs = {i: [] for i in layers}
    acts = {i: [] for i in layers}
    hooks = {}
    for i in layers:
        hooks[N.blk(i, N.FFN_IN_HOOK)] = lambda n, x: xs[N.layer_of(n)].append(x.copy())
        hooks[N.blk(i, N.FFN_ACT_HOOK)] = lambda n, x: acts[N.layer_of(n)].append(x.copy())
    for chunk in windows(ids, window):
        tick()
        forward(model, chunk, hooks=hooks, logits="none")
    return {i: np.concatenate(v) for i, v in xs.items()}, {i: np.concatenate(v) for i, v in acts.items()}


def _top_singular(w: np.ndarray, r: int):
    """The top-r singular triplets (U float64[m, r], S float64[r], Vt float64[r, n]) of w float[m, n], from the
    eigenvectors of its Gram matrix over the smaller side: the rank-r SVD np.linalg.svd gives, in a third of its time
    on one core for a 1536 x 576 gate, and a tenth with two BLAS threads on a busy machine (r << min(m, n))."""
    w64 = np.asarray(w, np.float64)
    flip = w64.shape[0] < w64.shape[1]
    if flip:
        w64 = w64.T
    ev, V = np.linalg.eigh(w64.T @ w64)
    top = np.argsort(ev)[::-1][:r]
    S, V = np.sqrt(np.maximum(ev[top], 0.0)), V[:, top]
    U = np.divide(w64 @ V, S, out=np.zeros((w64.shape[0], len(top))), where=S > 0)
    return (V, S, U.T) if flip else (U, S, V.T)


def _sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free


def _fit(x, y, A, B, b, steps: int, lr: float):
    """Full-batch Adam on mean binary cross-entropy; x float32[n, h], y bool[n, f]."""
    params = [A, B, b]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    yf = y.astype(np.float32)
    n = len(x)
    for t in range(1, steps + 1):
        h = x @ A
        g = (_sigmoid(h @ B + b) - yf) / (n * y.shape[1])  # dL/dlogits
        grads = [x.T @ (g @ B.T), h.T @ g, g.sum(axis=0)]
        for p, gr, mm, vv in zip(params, grads, m, v):
            mm *= 0.9
            mm += 0.1 * gr
            vv *= 0.999
            vv += 0.001 * gr * gr
            p -= lr * (mm / (1 - 0.9 ** t)) / (np.sqrt(vv / (1 - 0.999 ** t)) + 1e-8)
    return A, B, b


@host_pass()  # the cores other processes leave free (edgeprobe_kernels.threads), decided again per window and layer
def train_predictors(model: Model, train_ids, test_ids, thresholds, rank: int = 32, steps: int = 40,
                     lr: float = 3e-3, target_recall: float = 0.95, window: int = 512,
                     progress: bool = True) -> PredictorReport:
    """Train one predictor per layer on `train_ids`, report on `test_ids` (see module doc).

    thresholds: tau per layer (SparsityStats.params["thresholds"] or calibrate_thresholds).
    """
    L = model.config.n_layers
    taus = [float(thresholds[i]) for i in range(L)]
    xtr, atr = _collect(model, train_ids, window, range(L))
    xte, ate = _collect(model, test_ids, window, range(L))
    rec, prec, frac, err, cuts, weights = [], [], [], [], [], {}
    for i in tqdm(range(L), desc="predictors", unit="layer", disable=not progress, leave=False):
        tick()
        ytr, yte = np.abs(atr[i]) > taus[i], np.abs(ate[i]) > taus[i]
        wg = model.weights[f"blk.{i}.ffn_gate.weight"]  # [ffn, hidden]
        U, S, Vt = _top_singular(wg, rank)
        A = np.ascontiguousarray((Vt.T * np.sqrt(S)), dtype=np.float32)
        B = np.ascontiguousarray((U * np.sqrt(S)).T, dtype=np.float32)
        b = np.zeros(wg.shape[0], np.float32)
        A, B, b = _fit(xtr[i], ytr, A, B, b, steps, lr)
        ptr = _sigmoid((xtr[i] @ A) @ B + b)
        # largest cutoff with recall >= target on the training tokens
        pos = np.sort(ptr[ytr])
        cut = float(pos[int(np.floor((1 - target_recall) * len(pos)))]) if len(pos) else 0.5
        cut = np.nextafter(np.float32(cut), np.float32(0))
        pred = _sigmoid((xte[i] @ A) @ B + b) > cut
        tp = np.logical_and(pred, yte).sum()
        rec.append(tp / max(yte.sum(), 1))
        prec.append(tp / max(pred.sum(), 1))
        frac.append(pred.mean())
        wd = model.weights[f"blk.{i}.ffn_down.weight"]
        err.append(float(np.sqrt(sq_norm(dropped_output(ate[i], ~pred, wd)) / sq_norm(ate[i] @ wd.T))))
        cuts.append(float(cut))
        weights[i] = (A, B, b)
    return PredictorReport(rank=rank, recall=np.array(rec, float), precision=np.array(prec, float),
                           predicted_fraction=np.array(frac, float), ffn_error=np.array(err),
                           cutoffs=np.array(cuts), train_tokens=sum(len(v) for v in atr.values()) // L,
                           test_tokens=sum(len(v) for v in ate.values()) // L, weights=weights)
