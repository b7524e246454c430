"""Test-time scaling by decoding many candidates at once (NPU test-time scaling paper §3.2): Best-of-N and a
step-level beam search over one decode session — on the agent (device.DecodeSession) or the host
(generate.HostSession), which share an interface: prefill(tokens) -> logits[1, V], reorder(indices),
step(tokens[B]) -> logits[B, V].

A scorer maps a candidate (its generated token ids and their log-probabilities under the model) to a
number, higher is better; the default is the model's own mean log-probability. A reward model or a
verifier plugs in the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling import log_softmax, sample


@dataclass
class Candidate:
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    score: float = float("-inf")


def mean_logprob(tokens, logprobs) -> float:
    """The default scorer: mean log-probability the model gave its own tokens."""
    return float(np.mean(logprobs)) if len(logprobs) else float("-inf")


def _decode(session, logits, cands, n_tokens, temperature, rng, stop):
    """Extend every candidate (one per batch row) by up to n_tokens; returns the last logits [B, V]."""
    live = np.ones(len(cands), bool)
    for _ in range(n_tokens):
        tok = sample(logits, temperature, rng)
        lp = log_softmax(logits)[np.arange(len(cands)), tok]
        for j, c in enumerate(cands):
            if live[j]:
                c.tokens.append(int(tok[j]))
                c.logprobs.append(float(lp[j]))
                if stop is not None and int(tok[j]) in stop:
                    live[j] = False
        if not live.any():
            break
        logits = session.step(tok)
    return logits


def best_of_n(session, prompt, n: int, max_tokens: int, temperature: float = 0.8, seed: int = 0, scorer=mean_logprob,
              stop=None) -> list[Candidate]:
    """Prefill once, fork into n candidates, decode them as one batch, score each: candidates, best first."""
    if n < 1 or max_tokens < 1:
        raise ValueError(f"n and max_tokens must be >= 1, got n={n}, max_tokens={max_tokens}")
    rng = np.random.default_rng(seed)
    logits = session.prefill(prompt)
    session.reorder([0] * n)
    cands = [Candidate() for _ in range(n)]
    _decode(session, np.repeat(logits, n, axis=0), cands, max_tokens, temperature, rng, stop)
    for c in cands:
        c.score = scorer(c.tokens, c.logprobs)
    return sorted(cands, key=lambda c: -c.score)


def beam_search(session, prompt, width: int, expand: int, step_tokens: int, n_steps: int, temperature: float = 0.8,
                seed: int = 0, scorer=mean_logprob) -> list[Candidate]:
    """Step-level beam search: keep `width` beams; each step samples `expand` continuations of `step_tokens`
    tokens from every beam (one batch of width * expand sequences), scores the whole candidates and keeps
    the best `width` (their KV rows, by reorder). Returns the beams, best first."""
    if min(width, expand, step_tokens, n_steps) < 1:
        raise ValueError("width, expand, step_tokens and n_steps must all be >= 1")
    rng = np.random.default_rng(seed)
    logits = session.prefill(prompt)
    beams, beam_logits = [Candidate()], logits
    for _ in range(n_steps):
        rows = [b for b in range(len(beams)) for _ in range(expand)]
        session.reorder(rows)
        cands = [Candidate(list(beams[b].tokens), list(beams[b].logprobs)) for b in rows]
        last = _decode(session, beam_logits[rows], cands, step_tokens, temperature, rng, None)
        for c in cands:
            c.score = scorer(c.tokens, c.logprobs)
        keep = sorted(range(len(cands)), key=lambda j: -cands[j].score)[:width]
        session.reorder(keep)
        beams, beam_logits = [cands[j] for j in keep], last[keep]
    return beams
