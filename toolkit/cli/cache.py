"""`edgeprobe cache`: the prepared-model cache's entries, current or stale (list); the stale ones removed (prune)."""
from __future__ import annotations

import json
import time


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _row(e: dict) -> dict:
    """An entry as --json prints it: modified as ISO 8601 UTC beside its epoch seconds."""
    return {**e, "modified_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e["modified"]))}


def _describe(e: dict) -> str:
    what = {"model": e["scheme"] or "?", "calibration": "calibration", "temp": "temporary"}[e["kind"]]
    why = {"unrecorded": "stale (no code version recorded: prepared before entries recorded it)",
           "incomplete": "stale (incomplete: an interrupted write or prune)",
           "writing": "being written (left alone)",
           "abandoned": "stale (left by an interrupted run)",
           "stale": f"stale (code {e['code_version']})"}.get(e["state"], e["state"])
    return f"{e['model'] or e['name']:<24} {what:<14} {_mb(e['bytes']):>12}  {_when(e['modified'])}  {why}"


def cmd_cache(args) -> int:
    return {"list": _list, "prune": _prune}[args.action](args)


def _list(args) -> int:
    from ..prepare import cache_entries, cache_root, code_version

    root, entries = cache_root(), cache_entries()
    stale = [e for e in entries if e["stale"]]
    summary = {"root": str(root), "code_version": code_version(), "entries": [_row(e) for e in entries],
               "bytes": sum(e["bytes"] for e in entries), "stale_bytes": sum(e["bytes"] for e in stale)}
    if args.json:
        print(json.dumps(summary))
        return 0
    if not entries:
        print(f"no prepared models in {root}")
        return 0
    print(f"{root} (code version {summary['code_version']}):")
    for e in entries:
        print("  " + _describe(e))
    print(f"{len(entries)} entries, {_mb(summary['bytes'])}; {len(stale)} stale, {_mb(summary['stale_bytes'])} "
          "(`edgeprobe cache prune` removes them)")
    return 0


def _prune(args) -> int:
    from ..prepare import cache_root, prune

    removed = prune(all=args.all, dry_run=args.dry_run)
    freed = sum(e["bytes"] for e in removed)
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        print(json.dumps({"root": str(cache_root()), "dry_run": args.dry_run, "all": args.all,
                          "removed": [_row(e) for e in removed], "bytes_freed": 0 if args.dry_run else freed,
                          "bytes": freed}))
        return 0
    for e in removed:
        print(f"{verb} {e['path']} ({_mb(e['bytes'])}, {e['state']})")
    print(f"{verb} {len(removed)} entries, {_mb(freed)} {'to free' if args.dry_run else 'freed'}"
          if removed else f"nothing to remove in {cache_root()}")
    return 0
