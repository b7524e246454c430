"""`edgeprobe` command line. Subcommands, flags and the JSON fields of --json are a contract:
extend them, never rename or remove them."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import EdgeprobeError, TextError


def _read_text(path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise TextError(f"text file {path} does not exist; pass an existing file to --text")
    if p.is_dir():
        raise TextError(f"{path} is a folder; pass a text file to --text")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TextError(f"{path} is not UTF-8 text ({e}); pass a UTF-8 text file") from e


def cmd_eval(args) -> int:
    from . import models
    from .corpus import corpus_path
    from .evaluate import perplexity

    model = models.load(args.model)
    text = _read_text(args.text or str(corpus_path("heldout")))
    ids = model.tokenizer.encode(text)
    res = perplexity(model, ids, window=args.window, max_windows=args.max_windows, progress=not args.no_progress)
    out = {"model": args.model, "text": args.text or "corpus:heldout", **res.to_dict()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"perplexity {res.perplexity:.3f} over {res.tokens_scored} tokens "
              f"({res.windows} windows of {res.window}); {res.tok_per_s:.0f} tok/s")
    return 0


def cmd_generate(args) -> int:
    from . import models
    from .generate import generate

    model = models.load(args.model)
    g = generate(model, args.prompt, n=args.n, temperature=args.temperature, seed=args.seed)
    if args.json:
        print(json.dumps({"prompt": g.prompt, "continuation": g.text, "tokens": g.tokens,
                          "prefill_tok_per_s": g.prefill_tok_per_s, "decode_tok_per_s": g.decode_tok_per_s}))
    else:
        print(g.prompt + g.text)
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(model=args.model, max_windows=args.max_windows)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgeprobe", description="Profile, quantize, schedule and run LLMs for phones.")
    sub = ap.add_subparsers(dest="command", required=True)

    e = sub.add_parser("eval", help="perplexity of a model on a text (non-overlapping windows)")
    e.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF path or Hugging Face folder")
    e.add_argument("--text", help="UTF-8 text file (default: the bundled held-out corpus)")
    e.add_argument("--window", type=int, default=512, help="window length in tokens (default 512)")
    e.add_argument("--max-windows", type=int, default=None, help="evaluate at most this many windows")
    e.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(fn=cmd_eval)

    g = sub.add_parser("generate", help="continue a prompt (greedy unless --temperature > 0)")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--prompt", required=True)
    g.add_argument("-n", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="the main job: real model in, numbers out")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--max-windows", type=int, default=None, help="limit the held-out evaluation")
    d.set_defaults(fn=cmd_demo)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except EdgeprobeError as e:
        print(f"edgeprobe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edgeprobe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
