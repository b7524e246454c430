"""Greedy and sampled generation through the one forward pass with a KV cache."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from edgeprobe_kernels.threads import host_pass

from .errors import TextError, TokenRangeError
from .forward import KVCache, forward
from .models import Model
from .sampling import sample


@dataclass
class Generation:
    prompt: str
    text: str  # the continuation only
    tokens: list[int]
    prefill_tok_per_s: float
    decode_tok_per_s: float


EMPTY_PROMPT = 'the prompt is empty; give at least one character of text (--prompt "...")'


def check_request(prompt: str, n: int) -> None:
    """TokenRangeError / TextError for what no model could continue: a negative -n, an empty prompt."""
    if n < 0:
        raise TokenRangeError(f"-n {n}: the number of tokens to generate must be 0 or more")
    if not prompt:
        raise TextError(EMPTY_PROMPT)


def generate(model: Model, prompt: str, n: int = 32, temperature: float = 0.0, seed: int = 0,
             stop_at_eos: bool = True) -> Generation:
    """Continue `prompt` by up to `n` tokens: greedy at temperature 0, else sampled with `seed` (sampling.sample,
    the draw of workflows.generate's host loop: the same seed and logits give the same tokens)."""
    check_request(prompt, n)
    ids = model.tokenizer.encode(prompt)
    if len(ids) == 0:
        raise TextError(EMPTY_PROMPT)
    rng = np.random.default_rng(seed)
    cache = KVCache(model.config)
    out: list[int] = []
    with host_pass() as threads:  # the cores other processes leave free (edgeprobe_kernels.threads), per step
        t0 = time.perf_counter()
        logits = forward(model, ids, cache, logits="last")
        t1 = time.perf_counter()
        for step in range(n):
            nxt = int(sample(logits[None], temperature, rng)[0])  # the agent workflows' draw: same seed, same tokens
            out.append(nxt)
            if stop_at_eos and nxt == model.tokenizer.eos_id:
                break
            if step + 1 < n:
                threads.tick()
                logits = forward(model, [nxt], cache, logits="last")
        t2 = time.perf_counter()
    steps = max(len(out) - 1, 0)
    return Generation(prompt=prompt, text=model.tokenizer.decode(out), tokens=out,
                      prefill_tok_per_s=len(ids) / (t1 - t0),
                      decode_tok_per_s=steps / (t2 - t1) if steps and t2 > t1 else float("nan"))


def replay(model: Model, prompt, fed, linear=None, hooks=None) -> list[np.ndarray]:
    """The host's simulation of a decode session (Device.generate): prefill `prompt` once, fork the KV cache
    into the batch, then feed fed[:, i] at step i. fed: int[batch, n]. Returns the prefill's last logits
    float32[1, vocab], then each step's float32[batch, vocab]. linear: e.g. a QuantizedModel's simulation;
    hooks: e.g. neurons.sparse_hooks (predicted FFN sparsity)."""
    fed = np.asarray(fed)
    B = fed.shape[0]
    cache = KVCache(model.config)
    with host_pass() as threads:  # the cores other processes leave free, decided again per step
        first = forward(model, np.asarray(prompt), cache, hooks=hooks, linear=linear, logits="last")
        out = [np.asarray(first).reshape(1, -1)]
        cache.reorder([0] * B)
        for i in range(fed.shape[1]):
            threads.tick()
            out.append(np.asarray(forward(model, fed[:, i:i + 1], cache, hooks=hooks, linear=linear,
                                          logits="last")).reshape(B, -1))
    return out


class HostSession:
    """The host's twin of device.DecodeSession (same interface): a KVCache here instead of on the agent.
    linear: e.g. a QuantizedModel's simulation (qm.linear); float linears by default."""

    def __init__(self, model: Model, linear=None):
        self.model, self.linear = model, linear
        self.cache = KVCache(model.config)
        self.batch = 1

    def prefill(self, tokens) -> np.ndarray:
        logits = forward(self.model, np.asarray(tokens), self.cache, linear=self.linear, logits="last")
        return np.asarray(logits).reshape(1, -1)

    def reorder(self, indices) -> None:
        self.cache.reorder(indices)
        self.batch = self.cache.batch

    def step(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens).reshape(-1, 1)
        logits = forward(self.model, tokens, self.cache, linear=self.linear, logits="last")
        return np.asarray(logits).reshape(self.batch, -1)
