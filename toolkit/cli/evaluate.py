"""`edgeprobe eval` and `edgeprobe generate`: the host's float (or simulated quantized) model on a text."""
from __future__ import annotations

import json

from .common import prepared_model, say_for


def cmd_eval(args) -> int:
    from .. import models
    from ..corpus import corpus_path, read_text_file
    from ..evaluate import perplexity
    from ..quant.qmodel import check_scheme

    check_scheme(args.scheme)
    model = models.load(args.model)
    text = read_text_file(args.text or corpus_path("heldout"))
    ids = model.tokenizer.encode(text)
    run_model, linear = model, None
    if args.scheme != "float":
        qm = prepared_model(model, args.scheme, not args.no_progress, say=say_for(args))
        run_model, linear = qm.model, qm.linear
    res = perplexity(run_model, ids, window=args.window, max_windows=args.max_windows, linear=linear,
                     progress=not args.no_progress, order=args.order)
    out = {"model": args.model, "scheme": args.scheme, "text": args.text or "corpus:heldout", "order": args.order,
           **res.to_dict()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"perplexity {res.perplexity:.3f} over {res.tokens_scored} tokens "
              f"({res.windows} windows of {res.window}); {res.tok_per_s:.0f} tok/s")
    return 0


def cmd_generate(args) -> int:
    from .. import models
    from ..generate import check_request, generate

    check_request(args.prompt, args.n)  # before the model loads: refused in a second, not after it
    model = models.load(args.model)
    g = generate(model, args.prompt, n=args.n, temperature=args.temperature, seed=args.seed)
    if args.json:
        print(json.dumps({"prompt": g.prompt, "continuation": g.text, "tokens": g.tokens,
                          "prefill_tok_per_s": g.prefill_tok_per_s, "decode_tok_per_s": g.decode_tok_per_s}))
    else:
        print(g.prompt + g.text)
    return 0
