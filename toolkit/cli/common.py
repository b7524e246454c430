"""What several commands share: the prepared (quantized, cached) model and one-line notes of what is prepared."""
from __future__ import annotations

import sys


def prepared_model(model, scheme: str, progress: bool, tolerance: float = 0.05, say=None):
    """`model` under `scheme`, calibrated on the bundled training corpus; prepared once and cached across runs
    (edgeprobe.prepare), each step said in one line through `say`."""
    from ..prepare import prepared

    return prepared(model, scheme, progress=progress, say=say, tolerance=tolerance)


def say_for(args):
    """One-line notes of what a command prepares: on stdout, or on stderr when stdout carries --json."""
    stream = sys.stderr if getattr(args, "json", False) else sys.stdout
    return lambda m: print(f"edgeprobe: {m}", file=stream, flush=True)
