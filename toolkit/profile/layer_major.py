"""Layer-major profiling: every window through layer i, then every window through layer i + 1 (issue 43, item 2).

The host's float pass (forward.py: the template's ops, graph.local.float_plan) is cut at layer boundaries; each
window keeps its live op outputs (the residual stream) between layers, so a pass reads each layer's weights once for
the whole corpus instead of once per window. Every op runs on the same inputs as in runner.run, so every hook sees
the same arrays: profiles whose statistics are order-free (max, integer counts) equal the window-major pass bit for
bit. Held at once: one layer's weights plus the hidden states of all windows (models.config.check_fits).
"""
from __future__ import annotations

from tqdm.auto import tqdm

from edgeprobe_kernels.threads import host_pass

from ..forward import HOST_OPS, _as_batch, _Host, float_linear
from ..graph.local import HostContext, HostRaised, float_plan
from ..models import Model
from ..models.config import check_fits
from .base import Profile
from .runner import combine_hooks, windows


def _per_window_state_free(p: Profile) -> bool:
    """Profiles that keep nothing between begin_window and end_window (their hooks see one window at a time in
    either order): those that do not override the two."""
    t = type(p)
    return t.begin_window is Profile.begin_window and t.end_window is Profile.end_window


def run_layers(model: Model, ids, *profiles, window: int = 512, max_tokens: int | None = None,
               progress: bool = True, desc: str = "profile"):
    """runner.run's pass in layer-major order: `ids` (int[tokens]) cut into windows of `window` tokens, each from an
    empty cache, no LM head; hooks fire layer by layer, every window in turn. Returns the profiles.

    Only profiles without per-window state (outliers, calibration histograms) can be fed this way: a profile that
    overrides begin_window / end_window (sparsity, experts) expects one window's hooks between the two."""
    bad = [type(p).__name__ for p in profiles if not _per_window_state_free(p)]
    if bad:
        raise ValueError(f"{', '.join(bad)} keeps per-window state (begin_window / end_window); profile it with "
                         "order='window'")
    chunks = windows(ids, window, max_tokens)
    check_fits(model.config, window, what=f"layer-major {desc} pass", name=model.name, windows_held=len(chunks))
    hooks = combine_hooks(p.hooks(model) for p in profiles)
    plan = float_plan(model.config, window, 1, False, "none", HOST_OPS)
    (lane, names), = [(lane, names) for lane, names in plan.lane_order.items() if names]
    segments: list[list[str]] = []
    for name in names:  # program order is layer-major already (template: chunk, layer, stage)
        layer = plan.ops[name].get("layer", -1)
        if segments and plan.ops[segments[-1][-1]].get("layer", -1) == layer:
            segments[-1].append(name)
        else:
            segments.append([name])
    ctx = HostContext(get=model.weights.__getitem__, lane=lane,
                      host=_Host(model, hooks, float_linear(model), model.head))
    tokens = [_as_batch(c, model.config.vocab_size)[0].reshape(-1) for c in chunks]
    results: list[dict] = [{} for _ in chunks]
    unread = [dict(plan.readers) for _ in chunks]
    keep = set(plan.outputs)
    for p in profiles:
        for c in chunks:
            p.begin_window(c)
    bar = tqdm(total=len(segments) * len(chunks), desc=desc, unit="win", disable=not progress, leave=False)
    with host_pass() as threads, bar:
        for seg in segments:
            for w in range(len(chunks)):
                threads.tick()
                _run_segment(plan, seg, {"tokens": tokens[w]}, ctx, results[w], unread[w], keep)
                bar.update(1)
    for p in profiles:
        for c in chunks:
            p.end_window(len(c))
    return profiles if len(profiles) != 1 else profiles[0]


def _run_segment(plan, names, inputs: dict, ctx, results: dict, unread: dict, keep: set) -> None:
    """executor.run_untraced's loop over some of a plan's ops: outputs no later op reads are dropped as they go."""
    steps = plan.steps
    for name in names:
        kind, fn, attrs, refs, _, _, _, reads, _ = steps[name]
        args = [results[key] if src == "op" else ctx.get(key) if src == "blob" else inputs[key] for src, key in refs]
        try:
            out = fn(args, attrs, ctx)
        except HostRaised as e:
            raise e.error.with_traceback(e.error.__traceback__) from None
        results[name] = out
        for key in reads:
            unread[key] -= 1
            if not unread[key] and key not in keep:
                del results[key]
