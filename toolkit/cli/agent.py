"""`edgeprobe agent` (start a device agent here) and `edgeprobe kernels check` (a backend against numpy)."""
from __future__ import annotations

import json
import sys


def cmd_agent(args) -> int:
    from edgeprobe_agent.__main__ import main as agent_main

    argv = ["--bind", args.bind, "--store", args.store]
    if args.memory_budget is not None:
        argv += ["--memory-budget", str(args.memory_budget)]
    if args.curve_keys:
        argv += ["--curve-keys", args.curve_keys]
    if args.lanes:
        argv += ["--lanes", args.lanes]
    argv += ["--npu-backend", args.npu_backend]
    return agent_main(argv)


def cmd_kernels(args) -> int:
    """kernels check: every kernel of a backend against its numpy reference; exit 1 on any mismatch."""
    from edgeprobe_kernels.check import BackendUnavailable, check

    try:
        res = check(args.backend, seed=args.seed)
    except BackendUnavailable as e:
        print(f"edgeprobe: error: backend {args.backend} is unavailable here: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res))
    else:
        for name, r in res["kernels"].items():
            verdict = "ok" if r["ok"] else "MISMATCH"
            print(f"{args.backend:7s} {name:22s} {r['cases']:3d} cases  bit-exact {str(r['bit_exact']):5s}  "
                  f"max |err| {r['max_abs_err']:.3g}  {verdict}")
    return 0 if res["ok"] else 1
