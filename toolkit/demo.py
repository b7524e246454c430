"""The main job, as a library call: `edgeprobe.demo.run_demo()` (also `edgeprobe demo`, `make demo`)."""
from __future__ import annotations

import time

from . import models
from .corpus import read_corpus
from .evaluate import perplexity
from .generate import generate

DEMO_PROMPT = "The Python language reference says that a generator function"


def run_demo(model: str = "smollm2-135m", max_windows: int | None = None, print_fn=print) -> dict:
    t0 = time.perf_counter()
    m = models.load(model)
    m.weights.materialize()
    t_load = time.perf_counter() - t0
    print_fn(f"model     {m!r}")
    print_fn(f"loaded in {t_load:.1f} s (weights dequantized once, then cached)")
    ids = m.tokenizer.encode(read_corpus("heldout"))
    ev = perplexity(m, ids, window=512, max_windows=max_windows)
    g = generate(m, DEMO_PROMPT, n=32)
    summary = {
        "model": model, "perplexity_heldout": round(ev.perplexity, 3), "tokens_scored": ev.tokens_scored,
        "prefill_tok_per_s": round(ev.tok_per_s, 1), "decode_tok_per_s": round(g.decode_tok_per_s, 1),
    }
    print_fn(f"held-out  perplexity {ev.perplexity:.3f} over {ev.tokens_scored} tokens "
             f"({ev.windows} windows of {ev.window}), {ev.tok_per_s:.0f} tok/s prefill")
    print_fn(f"greedy    {DEMO_PROMPT!r} ->\n          {g.text!r}")
    print_fn(f"decode    {g.decode_tok_per_s:.1f} tok/s (float32 reference, KV cache)")
    return summary
