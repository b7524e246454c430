"""`edgeprobe profile outliers|sparsity|experts`: a corpus statistic, in one process or sharded over Ray."""
from __future__ import annotations

import json
import sys

from .common import say_for


def cmd_profile(args) -> int:
    from pathlib import Path

    from .. import models
    from ..corpus import corpus_path, read_text_file

    if args.shards is not None and args.ray is None:
        print("edgeprobe: error: --shards splits the corpus over a Ray cluster; add --ray local (or --ray ADDRESS)",
              file=sys.stderr)
        return 2
    progress = not args.no_progress
    runner = None
    try:
        if args.ray is not None:  # first: a cluster that cannot be reached fails before the model loads
            from ..profile.cluster import RayRunner

            runner = RayRunner(args.ray, shards=args.shards, say=say_for(args))
        text = read_text_file(args.corpus or corpus_path("train"))
        model = models.load(args.model or ("tiny-moe" if args.what == "experts" else "smollm2-135m"))
        ids = model.tokenizer.encode(text)
        summary, headline = _profile_job(args, model, ids, progress, runner)
        if runner is not None:  # where every shard ran; summary.json stays the single-process one
            (Path(args.out) / "shards.json").write_text(json.dumps(runner.summary(), indent=1) + "\n")
    finally:
        if runner is not None:
            runner.close()
    summary["out"] = str(args.out)
    if args.json:
        print(json.dumps({**summary, **({"ray": _ray_fields(runner)} if runner else {})}, default=float))
    else:
        print(headline)
        kind = "coactivation" if args.what == "experts" else args.what
        print(f"wrote {args.out}/{kind}.npz, summary.json{', shards.json' if runner else ''} and figures")
    return 0


def _ray_fields(runner) -> dict:
    s = runner.summary()
    return {"address": s["address"], "shards": len(s["shards"]), "workers": s["workers"], "hosts": s["hosts"],
            "shard_seconds": round(sum(r["seconds"] for r in s["shards"]), 3)}


def _profile_job(args, model, ids, progress: bool, runner) -> tuple[dict, str]:
    """The job `edgeprobe profile WHAT` runs -> (summary, headline)."""
    from ..corpus import corpus_path, read_text_file
    from ..profile import jobs

    if args.what == "experts":
        held = model.tokenizer.encode(read_text_file(args.heldout or corpus_path("heldout")))
        window = args.window or min(256, model.config.context_length)
        summary = jobs.run_experts_job(model, ids, held, args.out, tokens=args.tokens or 32768, window=window,
                                       heldout_tokens=args.heldout_tokens, bit_widths=args.bit_widths,
                                       progress=progress, runner=runner, order=args.order)
        pl, hr = summary["path_power_law"], summary["predictor_hit_rate"]
        k = model.config.n_experts_used
        headline = (f"experts: top 20% of {pl['paths_observed']} paths cover "
                    f"{100 * summary['top20pct_paths_token_share']:.1f}% of tokens "
                    f"(power law alpha {pl['alpha']:.2f}); "
                    f"preload hit rate top-{k} {100 * hr['order2'][f'top{k}']:.1f}% (frequency only "
                    f"{100 * hr['order0'][f'top{k}']:.1f}%)")
    elif args.what == "outliers":
        summary = jobs.run_outliers_job(model, ids, args.out, tokens=args.tokens or 32768, window=args.window or 512,
                                        percentile=args.percentile, prune_rate=args.prune_rate,
                                        coverage=args.coverage, progress=progress, runner=runner,
                                        order=args.order)
        headline = (f"outliers: {summary['fig10_outlier_channels_per_window_mean']:.1f} channels per window "
                    f"({summary['fig10_outlier_channels_pct_mean']:.2f}%); 80% of outliers from "
                    f"{summary['fig11_pct_channels_for_80pct_outliers']:.2f}% of channels; kept layers "
                    f"{summary['kept_layers']}")
    else:
        summary = jobs.run_sparsity_job(model, ids, args.out, tokens=args.tokens or 16384, window=args.window or 512,
                                        eps=args.eps, bits=args.bits, rank=args.rank,
                                        predictor=not args.no_predictor, progress=progress, runner=runner,
                                        order=args.order)
        headline = (f"sparsity: {100 * summary['inactive_fraction_mean']:.1f}% of FFN neurons inactive at "
                    f"eps {100 * args.eps:g}% (achieved {100 * summary['achieved_error_mean']:.2f}%); "
                    f"80% of firings from {summary['hot_neurons_pct_for_80pct_mean']:.0f}% of neurons")
    return summary, headline
