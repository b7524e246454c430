"""`edgeprobe trace`: open a written trace again (show) and import a phone's trace from another tool (import)."""
from __future__ import annotations

import json
from pathlib import Path


def _write_html(fig, path: Path) -> Path:
    """The figure as one self-contained page (plotly.js inlined: opens offline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    return path


def _model(arg: str):
    """--model as align() takes it: an edgeprobe ModelConfig's fields in a .json (n_layers, hidden, ...) as a dict,
    else the path (an HF config.json or folder, a GGUF)."""
    p = Path(arg)
    if p.suffix == ".json" and p.is_file():
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            doc = None
        if isinstance(doc, dict) and "n_layers" in doc and "hidden" in doc:
            return doc
    return arg


def cmd_trace(args) -> int:
    return {"show": _show, "import": _import}[args.action](args)


def _show(args) -> int:
    """FILE (edgeprobe's trace JSON, or Chrome/Perfetto JSON as --trace writes) -> the timeline as offline HTML."""
    from ..trace import Trace

    trace = Trace.load(args.file, process=args.process)
    out = Path(args.out) if args.out else Path(args.file).with_suffix(".html")
    _write_html(trace.figure(trace.meta.get("title")), out)
    m = trace.metrics()
    summary = {"trace": str(args.file), "timeline": str(out), "events": len(trace.events), "lanes": trace.lanes,
               "lane_labels": {l: trace.lane_label(l) for l in trace.lanes}, "times": trace.provenance(),
               "makespan_ms": m["makespan_ms"]}
    if args.json:
        print(json.dumps(summary))
    else:
        labels = "; ".join(summary["lane_labels"].values())
        print(f"wrote {out}: {len(trace.events)} events ({summary['times']} times), makespan "
              f"{m['makespan_ms']:.2f} ms; lanes {labels}")
    return 0


def _import(args) -> int:
    """A foreign trace -> DIR/trace.json (Perfetto) and DIR/timeline.html; with --model, aligned to the template
    (DIR/aligned.json keeps every event's template ops or why none) and, with --fit, a cost model fitted from it."""
    from ..errors import EdgeprobeError
    from ..trace import Trace

    if args.fit and not args.model:
        raise EdgeprobeError("--fit needs --model: the cost model is fitted from ops aligned to the model's template")
    trace = Trace.load_foreign(args.file, args.format, mhz=getattr(args, "mhz", None))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"file": str(args.file), "format": trace.meta["source"]["format"], "source": trace.meta["source"],
               "events": len(trace.events), "lanes": trace.lanes,
               "skipped": trace.meta.get("skipped_lines", trace.meta.get("skipped_events", 0)),
               "trace": str(out / "trace.json"), "timeline": str(out / "timeline.html")}
    shown: Trace = trace
    alignment = None
    if args.model:
        from ..foreign.align import align

        alignment = align(trace, _model(args.model))
        shown = alignment.trace
        alignment.trace.save(out / "aligned.json")
        summary.update(aligned_share=alignment.share, aligned_us=alignment.matched_us, total_us=alignment.total_us,
                       unmatched_events=sum(1 for e in shown.events if "unmatched" in e),
                       aligned=str(out / "aligned.json"))
    shown.to_chrome_json(out / "trace.json")
    _write_html(shown.figure(f"{trace.meta.get('title', args.file)} ({summary['format']}, measured)"),
                out / "timeline.html")
    if alignment is not None and args.fit:
        from ..foreign.fit import fit

        model = fit(alignment, name=Path(args.fit).stem)
        model.to_json(args.fit)
        summary.update(fit=str(args.fit), held_out_median_rel_error=model.held_out.get("median_rel_error"))
    if args.json:
        print(json.dumps(summary, default=str))
        return 0
    tool = summary["source"].get("tool") or summary["format"]
    print(f"read {summary['events']} events from {args.file} ({tool}; {summary['skipped']} records skipped), "
          f"lanes {', '.join(trace.lanes)}")
    if alignment is not None:
        print(f"aligned to {args.model}'s template: {100 * alignment.share:.1f}% of the measured time "
              f"({alignment.matched_us:.0f} of {alignment.total_us:.0f} us); {summary['unmatched_events']} events "
              "unmatched (kept, tagged with why)")
    if "fit" in summary:
        err = summary["held_out_median_rel_error"]
        print(f"wrote the fitted cost model {args.fit}" + (f" (held-out median error {100 * err:.0f}%)"
                                                            if err is not None else ""))
    print(f"wrote {summary['trace']} (Perfetto) and {summary['timeline']}")
    return 0
