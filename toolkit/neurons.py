"""LLM in a flash on the device agent (§3): FFN neurons bundled on flash, predicted per token, windowed in DRAM.

Host side. `add_bundles` adds to a QuantizedModel (scheme "float": attention and embeddings stay resident)
one bundle per layer, float16[ffn, 3, hidden] — neuron j's gate row, up row and down column side by side, so
one read fetches a neuron — plus the low-rank predictors (profile.predictor) as blobs. The agent's
`ffn_flash` op (edgeprobe_agent.neurons) then reads only the predicted neurons it lacks, keeping those used
in the last k tokens. `sparse_hooks` simulates the same predicted sparsity in the host's forward pass:
for the logits check, and for the perplexity cost of the predictions.
"""
from __future__ import annotations

import numpy as np

from edgeprobe_kernels import names as N
from edgeprobe_kernels.neurons import predicted_mask

from .models import Model


def bundle(model: Model, layer: int) -> np.ndarray:
    """float16[ffn, 3, hidden]: rows [gate_j, up_j, down[:, j]] (row-column bundling)."""
    W = model.weights
    g, u = W[f"blk.{layer}.ffn_gate.weight"], W[f"blk.{layer}.ffn_up.weight"]   # [ffn, hidden]
    d = W[f"blk.{layer}.ffn_down.weight"]                                          # [hidden, ffn]
    return np.ascontiguousarray(np.stack([g, u, d.T], axis=1), dtype=np.float16)


def add_bundles(qm, model: Model, predictors) -> dict:
    """Add every layer's neuron bundle and predictor to `qm` (manifest["neurons"]); bundles are listed in
    manifest["streamed_blobs"]: read from flash on demand, not counted as resident. predictors: a
    PredictorReport (train_predictors) with weights for every layer."""
    if model.config.n_experts:
        raise ValueError("neuron streaming is for dense FFNs; for MoE models stream experts instead")
    L = model.config.n_layers
    missing = [i for i in range(L) if i not in predictors.weights]
    if missing:
        raise ValueError(f"the predictors lack layers {missing[:5]}; train them for every layer")
    neurons, streamed = {}, []
    for i in range(L):
        A, B, b = predictors.weights[i]
        sha = qm.store.put(bundle(model, i), f"blk.{i}.ffn_bundle")
        streamed.append(sha)
        neurons[str(i)] = {"bundle": sha, "A": qm.store.put(np.asarray(A, np.float32), f"blk.{i}.pred_A"),
                           "B": qm.store.put(np.asarray(B, np.float32), f"blk.{i}.pred_B"),
                           "b": qm.store.put(np.asarray(b, np.float32), f"blk.{i}.pred_b"),
                           "cutoff": float(predictors.cutoffs[i])}
    qm.manifest["neurons"] = neurons
    qm.manifest["streamed_blobs"] = streamed
    qm.manifest["blobs"] = qm.store.meta
    return neurons


__all__ = ["bundle", "add_bundles", "predicted_mask", "sparse_hooks", "sparsity_perplexity"]


def sparse_hooks(predictors, union: bool = False, counts: list | None = None) -> dict:
    """Forward hooks computing the FFN only over predicted neurons (the rest read as zero): at ffn_in the
    predictor runs, at ffn_act the mask applies. union: one set for all rows (what the agent does for a
    prompt); else each token its own (decode, perplexity). counts collects (layer, active neurons / row)."""
    masks: dict = {}

    def at_in(name, x):
        i = N.layer_of(name)
        A, B, b = predictors.weights[i]
        m = predicted_mask(x, A, B, b, float(predictors.cutoffs[i]))
        masks[i] = m.any(axis=0, keepdims=True) if union else m
        if counts is not None:
            counts.append((i, float(masks[i].sum(axis=-1).mean())))
        return x

    def at_act(name, a):
        return a * masks[N.layer_of(name)]

    hooks = {}
    for i in predictors.weights:
        hooks[N.blk(i, N.FFN_IN_HOOK)] = at_in
        hooks[N.blk(i, N.FFN_ACT_HOOK)] = at_act
    return hooks


def sparsity_perplexity(model: Model, predictors, ids, window: int = 256, max_windows: int | None = 4,
                        progress: bool = False) -> dict:
    """The accuracy cost of predicted sparsity: held-out perplexity with every FFN computed densely and with
    only each token's predicted neurons, same windows; plus the mean fraction of neurons predicted active."""
    from .evaluate import perplexity

    counts: list = []
    dense = perplexity(model, ids, window=window, max_windows=max_windows, progress=progress)
    sparse = perplexity(model, ids, window=window, max_windows=max_windows, progress=progress,
                        hooks=sparse_hooks(predictors, counts=counts))
    return {"dense_ppl": dense.perplexity, "sparse_ppl": sparse.perplexity,
            "ppl_increase": sparse.perplexity / dense.perplexity - 1,
            "predicted_active_fraction": float(np.mean([c for _, c in counts])) / model.config.ffn}
