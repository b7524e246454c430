"""`edgeprobe schedule`: a prompt's chunk graph ordered on the lanes over a cost model, predicted only."""
from __future__ import annotations

import json
import sys

from .common import prepared_model, say_for


def cost_kind(cost) -> str:
    """What a cost model's times are: "fitted from a trace" (foreign.fit), "measured" (on an agent), "modelled"."""
    from ..schedule.cost import FittedCostModel

    if isinstance(cost, FittedCostModel):
        return "fitted from a trace"
    return "modelled" if cost.modelled else "measured"


def cmd_schedule(args) -> int:
    from .. import models
    from ..quant.qmodel import check_scheme
    from ..schedule import ScheduleError, cache, cost_model, predicted_schedule, schedule
    from ..schedule.predict import plan_of

    check_scheme(args.scheme)
    model = models.load(args.model)
    try:
        if args.prompt_len < 1:
            raise ScheduleError(f"prompt length must be a positive number of tokens, got {args.prompt_len}")
        if args.chunk < 1:
            raise ScheduleError(f"chunk length must be a positive number of tokens, got {args.chunk}")
        if args.prompt_len > model.config.context_length:
            raise ScheduleError(f"prompt length {args.prompt_len} exceeds the model's context length "
                                f"{model.config.context_length}")
        # a named cost model or .json is checked before the model is prepared (minutes when not cached)
        cost = None if args.cost_model in cache.MEASURED else cost_model(args.cost_model)
        if model.meta.get("format") == "config":  # a config.json alone: the scheme's stand-in records, no weights
            if cost is None:
                raise ScheduleError(f"{args.model} is a config.json alone (no weights), and a measured cost model runs "
                                    "the model on an agent: name a modelled one (snapdragon-8gen3, this-host-emulated)")
            manifest = plan_of(model, args.scheme)
        else:
            # the model `run --scheme` runs, from the same prepared-model cache: its manifest decides which layers
            # keep their shadow-outlier GEMMs, so this prediction is the one `run --cost-model` makes
            qm = prepared_model(model, args.scheme, not args.no_progress, say=say_for(args))
            if cost is None and not args.remeasure:
                cost = cache.cached(args.cost_model, args.model, args.scheme)
            if cost is None:  # measured on a local agent, over the held-out corpus
                from ..corpus import read_corpus
                from ..device import Device

                with Device.local() as dev:
                    cost = cache.resolve(args.cost_model, args.model, qm, dev,
                                         model.tokenizer.encode(read_corpus("heldout")), not args.no_progress,
                                         remeasure=True)
            manifest = qm.manifest
        chunk = min(args.chunk, args.prompt_len)  # as run: a chunk longer than the prompt is one chunk of all of it
        graph, sched = predicted_schedule(manifest, args.prompt_len, chunk, args.scheduler, cost)
    except ScheduleError as e:
        print(f"edgeprobe: error: {e}", file=sys.stderr)
        return 2
    base = schedule(graph, cost, "in-order") if args.scheduler != "in-order" else sched
    mem = graph.memory()
    out = {"model": args.model, "scheme": args.scheme, "prompt_len": args.prompt_len, "chunk": args.chunk,
           "scheduler": args.scheduler,
           # device_profile, profile_source: the fields' first names (a contract); cost_model says the same
           "device_profile": cost.name, "cost_model": cost.name, "modelled": cost.modelled,
           "cost_kind": cost_kind(cost), "profile_source": cost.source,
           "prediction_error": cost.fit_error() if hasattr(cost, "fit_error") else None,
           "subgraphs": len(graph.subgraphs), "makespan_ms": sched.makespan_us / 1e3,
           "makespan_vs_in_order": sched.makespan_us / base.makespan_us,
           "lanes": {k: round(v, 2) for k, v in sched.busy().items()}, "decision_us": sched.decision_us,
           "memory": {k: mem[k] for k in ("chunk_graphs_bytes", "chunk_shared_bytes", "saving", "shared_subgraphs",
                                          "subgraphs_per_chunk")}, "out": args.out}
    if args.out:
        from pathlib import Path

        doc = {**out, "slots": {n: {"lane": l, "start_us": s, "end_us": e} for n, (l, s, e) in sched.slots.items()},
               "deps": {g.name: g.deps for g in graph.subgraphs}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc))
    if args.json:
        print(json.dumps(out))
    else:
        busy = ", ".join(f"{k} {v:.0f}%" for k, v in out["lanes"].items())
        how = cost_kind(cost)
        print(f"{args.scheduler} of {args.scheme} on the {cost.name} cost model ({how}): makespan "
              f"{out['makespan_ms']:.1f} ms "
              f"({out['makespan_vs_in_order']:.2f}x in-order), busy {busy}; {len(graph.subgraphs)} subgraphs, "
              f"{sched.decision_us:.1f} us per decision; chunk-shared graphs save {100 * mem['saving']:.0f}% memory")
    return 0
