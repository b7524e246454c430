"""`edgeprobe quantize`: the accuracy table of every scheme, or one quantized model written to a folder."""
from __future__ import annotations

import json
import sys


def _expert_bits(model, tolerance: float, progress: bool) -> dict:
    """moe-mixed widths chosen on the bundled training corpus (never on the evaluation text)."""
    from ..corpus import read_corpus
    from ..quant.expert_bits import ExpertBitsStudy

    study = ExpertBitsStudy(model, model.tokenizer.encode(read_corpus("train")),
                            window=min(256, model.config.context_length), max_windows=4, progress=progress)
    return study.select(tolerance).bits


def cmd_quantize(args) -> int:
    from .. import models
    from ..corpus import corpus_path, read_corpus, read_text_file
    from ..quant import calibration_profile, quantize, schemes_for
    from ..quant.qmodel import check_scheme
    from ..quant.report import accuracy_table, format_table
    from ..quant.schemes import NEEDS_PROFILE

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
    needed = set(schemes if args.report else []) | ({args.scheme or schemes[0]} if args.out else set())
    profile = None
    if needed & NEEDS_PROFILE:
        profile = calibration_profile(model, model.tokenizer.encode(read_corpus("train")), tokens=args.calib_tokens,
                                      window=min(args.window, args.calib_tokens), progress=progress)
    bits = _expert_bits(model, args.tolerance, progress) if "moe-mixed" in needed else None
    if args.out:
        scheme = args.scheme or schemes[0]
        qm = quantize(model, scheme, profile, prune_rate=args.prune_rate, coverage=args.coverage, expert_bits=bits)
        qm.save(args.out)
        print(f"wrote {scheme} to {args.out} ({qm.nbytes()['total'] / 1e6:.1f} MB in "
              f"{len(qm.manifest['blobs'])} blobs)")
    if args.report:
        rows = accuracy_table(model, model.tokenizer.encode(text), profile, schemes, window=args.window,
                              max_windows=args.max_windows, progress=progress, prune_rate=args.prune_rate,
                              coverage=args.coverage, expert_bits=bits)
        if args.json:
            print(json.dumps({"model": args.model, "text": args.text or "corpus:heldout", "rows": rows}))
        else:
            print(format_table(rows))
    return 0
