"""Perplexity over non-overlapping windows, each from an empty cache."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
from tqdm.auto import tqdm

from edgeprobe_kernels.sampling import log_softmax  # noqa: F401  (re-exported: evaluate.log_softmax)
from edgeprobe_kernels.threads import host_pass, run_blocks, side_by_side

from .errors import TextError, WindowError
from .forward import Hooks, LinearFn, forward, forward_layers
from .models import Model
from .models.config import check_fits, fits

NLL_ROWS = 64  # logit rows a block of window_nll: a [512, 49152] window's exp is ~0.1 s, shared by the threads


@dataclass
class EvalResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, nats
    tokens_scored: int
    windows: int
    window: int
    tokens_total: int  # tokens in the text, including the dropped tail
    seconds: float
    tok_per_s: float  # tokens run through the model per second (windows * window / seconds)

    def to_dict(self) -> dict:
        return asdict(self)


def window_nll(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per-position NLL of ids[1:] given logits[:-1]: float64[W-1].

    NLL = logsumexp(z) - z[target]; exp in float32 (safe after subtracting the max), sums in float64.
    """
    z, target = logits[:-1], np.asarray(ids)[1:]
    out = np.empty(len(z), np.float64)

    def rows(a, b):  # each row alone: the same bits however the rows are cut and shared between threads
        zz = z[a:b]
        m = zz.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(zz - m).sum(axis=-1, dtype=np.float64)) + m[:, 0]
        out[a:b] = lse - zz[np.arange(b - a), target[a:b]].astype(np.float64)

    run_blocks(rows, [(a, min(len(z), a + NLL_ROWS)) for a in range(0, len(z), NLL_ROWS)])
    return out


def perplexity(model: Model, ids, window: int = 512, hooks: Hooks = None, linear: LinearFn | None = None,
               max_windows: int | None = None, progress: bool = True, order: str = "window") -> EvalResult:
    """Perplexity of `ids` (int[tokens]) in non-overlapping windows of `window` tokens.

    Each window starts from an empty cache and scores its positions 1..window-1; a last window
    shorter than `window` is dropped. `hooks`/`linear` pass through to the forward pass, so the same
    function evaluates quantized simulations. Models whose tokenizer adds BOS (Gemma) see windows of BOS +
    (window - 1) text tokens and all window - 1 text tokens are scored, as llama.cpp's perplexity does; a
    leading BOS in `ids` (from encode) is dropped first. A model whose one layer, a window's activations and
    logits exceed the memory limit is refused first (models.config.check_fits). Threads: the cores other
    processes leave free (edgeprobe_kernels.threads); where the pass starts with two or more, the float model's
    windows run side by side (threads.side_by_side), else in turn, the count decided again per window.
    order="layer" runs every window through layer i before layer i+1 (forward.forward_layers): each layer's weights
    read once, the windows' hidden states held between layers; the same NLL bits, summed in the same window order.
    """
    if order not in ("window", "layer"):
        raise ValueError(f"order must be 'window' or 'layer', got {order!r}")
    if not isinstance(window, (int, np.integer)) or window < 2:
        raise WindowError(f"window must be an integer >= 2 (it scores positions 1..window-1), got {window!r}")
    if window > model.config.context_length:
        raise WindowError(f"window {window} exceeds the model's context length {model.config.context_length}; "
                          "use a smaller --window")
    # before the tokenizer is touched: a model known by its config alone is refused with the numbers too
    check_fits(model.config, window, what="perplexity pass", logits=True, name=model.name)
    ids = np.asarray(ids)
    if ids.size == 0:
        raise TextError("the text is empty (no tokens); pass a text file with content")
    tok = model.tokenizer
    bos = tok.bos_id if tok is not None and tok.add_bos and tok.bos_id is not None else None
    if bos is not None and ids.size and ids[0] == bos:
        ids = ids[1:]
    step = window - 1 if bos is not None else window  # text tokens per window
    n = len(ids) // step
    if n == 0:
        raise TextError(f"the text has {len(ids)} tokens, fewer than one window of {window}; "
                        f"pass a longer text or a smaller --window (at most {len(ids)})")
    if max_windows is not None:
        n = min(n, int(max_windows))
    chunks = [ids[w * step:(w + 1) * step] for w in range(n)]
    if bos is not None:
        chunks = [np.concatenate([[bos], c]).astype(ids.dtype) for c in chunks]
    total, t0 = 0.0, time.perf_counter()
    if order == "layer":
        check_fits(model.config, window, what="layer-major perplexity pass", logits=True, name=model.name,
                   windows_held=n)
        nll = []  # each window's sum as its logits come, in window order: the window-major total's additions

        def scored(w, logits):
            nll.append(float(window_nll(logits, chunks[w]).sum()))
        with tqdm(desc="perplexity", unit="win", disable=not progress, leave=False) as bar:
            forward_layers(model, chunks, scored, hooks=hooks, linear=linear, logits="all", bar=bar)
        for x in nll:
            total += x
    else:
        sums: list = []

        def compute(w):
            return float(window_nll(forward(model, chunks[w], hooks=hooks, linear=linear), chunks[w]).sum())

        def commit(w, s):
            sums.append(s)
            bar.update(1)
        with host_pass() as threads, tqdm(total=n, desc="perplexity", unit="win", disable=not progress,
                                          leave=False) as bar:
            k = threads.tick()  # beside other processes (one thread) the windows run in turn, their GEMMs spread
            # windows side by side on the float model alone (a caller's hooks may replace activations, its linears
            # run their own threads), where k windows' logits fit too
            if k > 1 and n > 1 and hooks is None and linear is None and fits(model.config, window, True, k):
                side_by_side(n, compute, commit, most=k)
            else:
                for w in range(n):
                    threads.tick()
                    commit(w, compute(w))
        for s in sums:  # the window-major total's additions, in window order
            total += s
    secs = time.perf_counter() - t0
    scored = n * (window - 1)
    nll = total / scored
    return EvalResult(perplexity=float(np.exp(nll)), nll=nll, tokens_scored=scored, windows=n, window=window,
                      tokens_total=len(ids), seconds=secs, tok_per_s=n * window / secs)
