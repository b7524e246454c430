"""Where edgeprobe keeps its state on this machine: one root, `$EDGEPROBE_CACHE`, else `$XDG_CACHE_HOME/edgeprobe`,
else `~/.cache/edgeprobe`. Every part lives under it (weights, prepared models, agent stores, the arm64 and Hexagon
builds, OpenCL program binaries, cost models), so moving or emptying that one folder moves or empties all of it.
The host (`edgeprobe.models.default_cache_dir`) and the agent read the same function."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$EDGEPROBE_CACHE, else $XDG_CACHE_HOME/edgeprobe, else ~/.cache/edgeprobe (not created here)."""
    if os.environ.get("EDGEPROBE_CACHE"):
        return Path(os.environ["EDGEPROBE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgeprobe"
