"""`edgeprobe quantize`: the accuracy table of every scheme, or one quantized model written to a folder."""
from __future__ import annotations

import json
import sys

from .common import say_for


def cmd_quantize(args) -> int:
    from .. import models
    from ..corpus import corpus_path, read_text_file
    from ..prepare import prepared
    from ..quant import schemes_for
    from ..quant.qmodel import check_scheme
    from ..quant.report import accuracy_table, format_table

    schemes = args.schemes.split(",") if args.schemes else None
    for s in schemes or []:
        check_scheme(s)
    if args.scheme:
        check_scheme(args.scheme)
    if not args.report and not args.out:
        print("edgeprobe: error: quantize needs --report (the accuracy table) and/or --out DIR (with --scheme)",
              file=sys.stderr)
        return 2
    text = read_text_file(args.text or corpus_path("heldout"))
    model = models.load(args.model)
    schemes = schemes or schemes_for(model.config)
    progress = not args.no_progress
    say = say_for(args)

    def prepare(scheme):  # every scheme from the prepared-model cache run, eval, the demo and the Python API share
        return prepared(model, scheme, progress, say, prune_rate=args.prune_rate, coverage=args.coverage,
                        tolerance=args.tolerance, calib_tokens=args.calib_tokens,
                        calib_window=min(args.window, args.calib_tokens))

    if args.out:
        scheme = args.scheme or schemes[0]
        qm = prepare(scheme)
        qm.save(args.out)
        print(f"wrote {scheme} to {args.out} ({qm.nbytes()['total'] / 1e6:.1f} MB in "
              f"{len(qm.manifest['blobs'])} blobs)")
    if args.report:
        rows = accuracy_table(model, model.tokenizer.encode(text), None, schemes, window=args.window,
                              max_windows=args.max_windows, progress=progress, prepare=prepare)
        if args.json:
            print(json.dumps({"model": args.model, "text": args.text or "corpus:heldout", "rows": rows}))
        else:
            print(format_table(rows))
    return 0
