"""`edgeprobe` command line. Subcommands, flags and the JSON fields of --json are a contract: extend them, never
rename or remove them.

parser.py builds the parser; one module per command family runs it: evaluate (eval, generate), quant (quantize),
profile, run, schedule, agent (agent, kernels), trace, cache (the prepared-model cache), demo.
"""
from __future__ import annotations

import sys

from ..errors import EdgeprobeError
from .parser import build_parser

__all__ = ["main", "build_parser"]


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
