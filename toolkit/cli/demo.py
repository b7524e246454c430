"""`edgeprobe demo`: the main job end to end (edgeprobe.demo)."""
from __future__ import annotations

import sys


def cmd_demo(args) -> int:
    from ..demo import DemoError, run_demo

    try:
        run_demo(model=args.model, out=args.out, prompt_len=args.prompt_len, chunk=args.chunk,
                 eval_windows=args.max_windows, profile_tokens=args.profile_tokens, progress=not args.no_progress,
                 repeats=args.repeats)
    except DemoError as e:
        print(f"edgeprobe: error: {e}", file=sys.stderr)
        return 2
    return 0
