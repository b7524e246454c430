"""Run profiles over a token stream window by window (constant memory, one progress bar), or layer by layer."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
from tqdm.auto import tqdm

from edgeprobe_kernels.threads import host_pass, settle, side_by_side

from ..errors import TextError, WindowError
from ..forward import forward, forward_layers
from ..models import Model
from ..models.config import check_fits, memory_limit
from .base import Profile


def windows(ids, window: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """Non-overlapping windows of `window` tokens (the tail shorter than a window is dropped)."""
    if not isinstance(window, (int, np.integer)) or window < 2:
        raise WindowError(f"window must be an integer >= 2, got {window!r}")
    ids = np.asarray(ids)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = len(ids) // window
    if n == 0:
        raise TextError(f"the corpus has {len(ids)} tokens, fewer than one window of {window}; "
                        "pass a longer corpus, more --tokens or a smaller --window")
    return [ids[i * window:(i + 1) * window] for i in range(n)]


def combine_hooks(hook_dicts) -> dict:
    """Several observers' {name: hook} dicts -> one dict calling each in turn (observe only)."""
    per_name = defaultdict(list)
    for d in hook_dicts:
        for name, fn in d.items():
            per_name[name].append(fn)

    def chain(fns):
        def hook(name, x):
            for fn in fns:
                fn(name, x)
        return hook
    return {name: fns[0] if len(fns) == 1 else chain(fns) for name, fns in per_name.items()}


def run(model: Model, ids, *profiles, window: int = 512, max_tokens: int | None = None,
        progress: bool = True, desc: str = "profile", order: str = "window"):
    """Feed `ids` (int[tokens]) through the forward pass, window by window, into each profile.

    Each window is one sequence from an empty cache; the LM head is skipped (profiles read hidden
    activations only). Memory does not grow with the number of tokens; a model whose one layer and a window's
    activations exceed the memory limit is refused first (models.config.check_fits). Returns the profiles.
    Threads: the cores other processes leave free (edgeprobe_kernels.threads). Where the pass starts with two or
    more, windows run side by side (threads.side_by_side): each keeps its hooked activations (at most
    side_by_side_budget() a window, else the windows run in turn) until the profiles see it, in window order: the
    same bits. Otherwise the windows run in turn, the count decided again per window.
    order "layer": every window through layer i, then layer i + 1 (run_layers; the same
    result, bit for bit, for profiles without per-window state).
    """
    if order == "layer":
        return run_layers(model, ids, *profiles, window=window, max_tokens=max_tokens, progress=progress, desc=desc)
    if order != "window":
        raise ValueError(f"order must be 'window' or 'layer', got {order!r}")
    chunks = windows(ids, window, max_tokens)
    check_fits(model.config, window, what=f"{desc} pass", name=model.name)  # one line, not the OOM killer
    hooks = combine_hooks(p.hooks(model) for p in profiles)

    def compute(w):  # the window's forward pass; its hooks' calls kept for the window's turn
        calls: list = []
        forward(model, chunks[w], hooks={n: lambda name, x: calls.append((name, x)) for n in hooks}, logits="none")
        return calls

    def commit(w, calls):  # the profiles see the windows in order, each window's hook calls in op order
        for p in profiles:
            p.begin_window(chunks[w])
        for name, x in calls:
            hooks[name](name, x)
        for p in profiles:
            p.end_window(len(chunks[w]))
        bar.update(1)

    with host_pass() as threads, tqdm(total=len(chunks), desc=desc, unit="win", disable=not progress,
                                      leave=False) as bar:
        k = threads.tick()  # beside other processes (one thread) the windows run in turn, their GEMMs spread
        if k > 1 and len(chunks) > 1 and _kept_bytes(model, hooks, window) <= side_by_side_budget():
            side_by_side(len(chunks), compute, commit, most=k)  # edgeprobe_kernels.threads.side_by_side
        else:
            for chunk in chunks:  # the hooks live: a profile's statistics run beside the next GEMM (threads.beside)
                threads.tick()
                for p in profiles:
                    p.begin_window(chunk)
                forward(model, chunk, hooks=hooks, logits="none")
                for p in profiles:
                    p.end_window(len(chunk))
                bar.update(1)
    return profiles if len(profiles) != 1 else profiles[0]


class Handover:
    """Two profiles fed by one window-major pass: its first `n` windows go to `first`; as window n begins,
    then(first) makes the second profile (what it needs of the first is settled: every window of it has ended)
    and the rest go to that one. One pass, not two, so windows side by side run across the handover (a
    calibration's last windows beside an outlier pass's first ones) where two passes would each drain.
    then may raise to stop the pass (run raises it); the second profile's hooks must be among the first's (the
    windows computed ahead recorded the first's). Window-major only: it keeps no per-window state for at_window."""

    def __init__(self, first: Profile, n: int, then):
        self.first, self.n, self.then = first, n, then
        self.second: Profile | None = None
        self._current, self._begun, self._model, self._hooks = first, 0, None, {}

    def hooks(self, model: Model) -> dict:
        self._model, self._hooks = model, self.first.hooks(model)
        return {name: self._hook for name in self._hooks}

    def _hook(self, name, x):
        self._hooks[name](name, x)

    def begin_window(self, ids: np.ndarray) -> None:
        if self._begun == self.n:
            settle()  # the first's last statistics, if they ran beside (threads.beside)
            self.second = self.then(self.first)
            hooks = self.second.hooks(self._model)
            if not set(hooks) <= set(self._hooks):
                raise ValueError(f"a handover's second profile hooks {sorted(set(hooks) - set(self._hooks))[:3]}, "
                                 "which the first does not")
            self._hooks = {name: hooks.get(name, _ignore) for name in self._hooks}
            self._current = self.second
        self._begun += 1
        self._current.begin_window(ids)

    def end_window(self, n_tokens: int) -> None:
        self._current.end_window(n_tokens)


def _ignore(name, x) -> None:
    """A hook the second profile of a Handover does not have."""


SIDE_BY_SIDE_BYTES = 1 << 30  # at most this many bytes of hooked activations a window keeps for its turn


def side_by_side_budget() -> int:
    """Bytes of activations a window-major pass may keep per window to run windows side by side: SIDE_BY_SIDE_BYTES,
    or an eighth of memory_limit() where that is less."""
    limit = memory_limit()[0]
    return SIDE_BY_SIDE_BYTES if limit is None else min(SIDE_BY_SIDE_BYTES, limit // 8)


def _kept_bytes(model: Model, hooks: dict, window: int) -> int:
    """An upper bound on the bytes a window's hooked activations take (float32[window, width] per hook, width the
    widest activation of the model): what a window computed beside another keeps until its turn."""
    c = model.config
    widest = max(c.hidden, c.n_heads * c.head_dim, c.ffn, c.expert_ffn, c.shared_expert_ffn, c.n_experts)
    return 4 * window * widest * len(hooks)


def _layer_major_ready(p: Profile) -> bool:
    """Profiles a layer-major pass can feed: those that keep nothing between begin_window and end_window, and those
    that keep it per window and switch in at_window (sparsity's resident neurons, co-activation's routing)."""
    t = type(p)
    free = t.begin_window is Profile.begin_window and t.end_window is Profile.end_window
    return free or getattr(t, "at_window", Profile.at_window) is not Profile.at_window  # Handover has none


def run_layers(model: Model, ids, *profiles, window: int = 512, max_tokens: int | None = None,
               progress: bool = True, desc: str = "profile"):
    """runner.run's pass in layer-major order: `ids` (int[tokens]) cut into windows of `window` tokens, each from an
    empty cache, no LM head; hooks fire layer by layer, every window in turn. Returns the profiles.

    Every window begins first, then the hooks fire (each profile's at_window(w) before window w's ops of a layer),
    then every window ends in order: a profile keeping per-window state must switch to window w's in at_window
    (Profile.at_window); one that overrides begin_window / end_window without it is refused."""
    bad = [type(p).__name__ for p in profiles if not _layer_major_ready(p)]
    if bad:
        raise ValueError(f"{', '.join(bad)} keeps per-window state (begin_window / end_window) without at_window; "
                         "profile it with order='window'")
    chunks = windows(ids, window, max_tokens)
    check_fits(model.config, window, what=f"layer-major {desc} pass", name=model.name, windows_held=len(chunks))
    hooks = combine_hooks(p.hooks(model) for p in profiles)
    for p in profiles:
        for c in chunks:
            p.begin_window(c)
    with tqdm(desc=desc, unit="win", disable=not progress, leave=False) as bar:
        forward_layers(model, chunks, lambda w, out: None, hooks=hooks, bar=bar,
                       at_window=lambda w: [p.at_window(w) for p in profiles])
    for p in profiles:
        for c in chunks:
            p.end_window(len(c))
    return profiles if len(profiles) != 1 else profiles[0]
