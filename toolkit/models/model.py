"""Model: a config, a tokenizer and lazily dequantized float32 weights under canonical GGUF names."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig
from .tokenizer import Tokenizer
from .weights import LazyWeights


@dataclass
class Model:
    """A loaded checkpoint.

    Weights use GGUF's tensor names (`token_embd.weight`, `blk.{i}.attn_q.weight`, …) with shape
    float32[out_features, in_features]; Q/K rows are in the "adjacent pairs" RoPE layout whatever
    the source format. `output.weight` is absent when the output projection is tied to the embedding.
    """

    config: ModelConfig
    tokenizer: Tokenizer
    weights: LazyWeights
    source: str
    sha256: str
    name: str = ""
    meta: dict = field(default_factory=dict)
    head: object = None  # x float32[M, hidden] -> logits, when the LM head is not x @ output_weight^T (Q8_0)

    def w(self, name: str) -> np.ndarray:
        return self.weights[name]

    def linear_weight(self, name: str) -> np.ndarray:
        """float32[out, in] of a linear by its forward-pass name ("blk.0.attn_q"); an expert linear
        "blk.{i}.ffn_up_exps.{e}" is expert e's slice of the stacked float32[E, out, in] tensor."""
        w = self.weights.get(name + ".weight")
        if w is not None:
            return w
        base, _, e = name.rpartition(".")
        if e.isdigit() and base + ".weight" in self.weights:
            part = getattr(self.weights, "part", None)  # LazyWeights reads one expert alone; a dict is sliced
            return part(base + ".weight", int(e)) if part else self.weights[base + ".weight"][int(e)]
        raise KeyError(f"no linear named {name!r} in this model")

    @property
    def output_weight(self) -> np.ndarray:
        """float32[vocab, hidden]: the LM head, the embedding itself when tied."""
        if "output.weight" in self.weights:
            return self.weights["output.weight"]
        return self.weights["token_embd.weight"]

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.name or c.name!r}, arch={c.arch}, layers={c.n_layers}, hidden={c.hidden}, "
                f"heads={c.n_heads}/{c.n_kv_heads}, vocab={c.vocab_size}, params={c.n_params()/1e6:.1f}M, "
                f"source={self.source!r})")
