"""The accuracy table: every scheme on the same model and text, beside float."""
from __future__ import annotations

import time

import numpy as np
from tqdm.auto import tqdm

from ..evaluate import window_nll
from ..forward import forward
from ..models import Model
from ..profile.runner import windows
from .qmodel import quantize, schemes_for


def accuracy_table(model: Model, ids, profile, schemes=None, window: int = 512, max_windows: int | None = 8,
                   progress: bool = True, quantized: dict | None = None, prepare=None, **quant_kw) -> list[dict]:
    """One row per scheme: perplexity, change vs float, top-1 agreement with float, bytes, tok/s, and
    channels_in_float_pct: the share of linear-input values (token x input channel) computed in float — the
    shadow GEMM's outliers for w8a8-shadow / w8a8c-shadow (mllm-NPU eq. 1), 100 for float, 0 for pure integer.

    All schemes see the same windows of `ids`; top-1 agreement is over every scored position.
    quantized: {scheme: QuantizedModel}, to keep the models for a later look (per-layer errors) and to reuse them:
    a scheme found there runs as it is (the caller made it with these settings; its counters start again at
    zero), a scheme not there is quantized here with `quant_kw` and added.
    prepare: scheme -> QuantizedModel (e.g. edgeprobe.prepare.prepared, the cache the CLI and the demo share), used
    instead of quantizing here; `profile` is then unused.
    """
    schemes = list(schemes or schemes_for(model.config))
    chunks = windows(ids, window)[:max_windows] if max_windows else windows(ids, window)
    float_top1 = [forward(model, c).argmax(-1) for c in chunks]
    rows = []
    for scheme in tqdm(schemes, desc="schemes", unit="scheme", disable=not progress, leave=False):
        qm = None if quantized is None else quantized.get(scheme)
        if qm is None and prepare is not None:
            qm = prepare(scheme)
            if quantized is not None:
                quantized[scheme] = qm
        elif qm is None:
            qm = quantize(model, scheme, profile if scheme != "float" else None, **quant_kw)
            if quantized is not None:
                quantized[scheme] = qm
        qm.counters.clear()
        nll, agree, n = 0.0, 0, 0
        t0 = time.perf_counter()
        for c, ref in zip(chunks, float_top1):
            logits = qm.forward(c)
            nll += float(window_nll(logits, c).sum())
            agree += int((logits.argmax(-1)[:-1] == ref[:-1]).sum())
            n += len(c) - 1
        secs = time.perf_counter() - t0
        b = qm.nbytes()
        c = qm.counters
        in_float = (100.0 if scheme == "float" else 100.0 * c["outliers"] / c["shadow_values"] if c["shadow_values"]
                    else None if scheme == "llm-int8" else 0.0)  # llm-int8 counts columns per call, not values
        rows.append({"scheme": scheme, "perplexity": float(np.exp(nll / n)), "tokens_scored": n,
                     "top1_agreement": agree / n, "weight_bytes": b["linear_weights"],
                     "shadow_resident_bytes": b["shadow_resident"], "shadow_flash_bytes": b["shadow_flash"],
                     "cold_bytes_read": int(qm.counters["cold_bytes_read"]), "tok_per_s": len(chunks) * window / secs,
                     "channels_in_float_pct": in_float})
    base = next((r["perplexity"] for r in rows if r["scheme"] == "float"), None)
    for r in rows:
        r["delta_vs_float_pct"] = None if base is None else 100.0 * (r["perplexity"] / base - 1)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'scheme':<13} {'ppl':>8} {'vs float':>9} {'top-1':>7} {'in float':>9} {'weights MB':>11} "
            f"{'shadow res MB':>14} {'shadow flash MB':>16} {'tok/s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        d, f = r["delta_vs_float_pct"], r.get("channels_in_float_pct")
        lines.append(f"{r['scheme']:<13} {r['perplexity']:8.3f} {('' if d is None else f'{d:+.2f}%'):>9} "
                     f"{100 * r['top1_agreement']:6.2f}% {('' if f is None else f'{f:.2f}%'):>9} "
                     f"{r['weight_bytes'] / 1e6:11.1f} {r['shadow_resident_bytes'] / 1e6:14.2f} "
                     f"{r['shadow_flash_bytes'] / 1e6:16.1f} {r['tok_per_s']:7.0f}")
    return "\n".join(lines)
