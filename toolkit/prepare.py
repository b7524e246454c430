"""Quantized models prepared once and reused across command lines: the calibration profile and the quantized
model, cached in $EDGEPROBE_PREPARED_CACHE, else in `prepared/` of the edgeprobe cache ($EDGEPROBE_CACHE, else
~/.cache/edgeprobe).

    qm = prepared(model, "w8a8-shadow", say=print)   # first call: calibrate + quantize (~40 s), then ~1 s

A cache entry is keyed by the model's sha256, the scheme, every setting that changes the result (calibration
tokens, window, percentile, prune rate, coverage, moe-mixed tolerance) and a hash of the quantizer's and kernels'
source, so an edit to either prepares again instead of reusing stale blobs. Entries are written to a temporary
folder and renamed into place: an interrupted run or two runs preparing at once never leave half an entry.
Each step says what it prepares and how long it took, one line each, through `say`.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from functools import lru_cache
from pathlib import Path

CALIB_TOKENS = 4096   # training-corpus tokens the activation clips are calibrated on (quant.calibration_profile)
CALIB_WINDOW = 512


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of the source that decides a prepared model's bytes: the quantizer, the profilers, the kernels."""
    root = Path(__file__).resolve().parent
    import edgeprobe_kernels

    files = sorted([*(root / "quant").glob("*.py"), *(root / "profile").glob("*.py"),
                    *Path(edgeprobe_kernels.__file__).resolve().parent.glob("*.py")])
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """$EDGEPROBE_PREPARED_CACHE, else <edgeprobe cache>/prepared ($EDGEPROBE_CACHE or ~/.cache/edgeprobe)."""
    import os

    from .models import default_cache_dir

    return Path(os.environ.get("EDGEPROBE_PREPARED_CACHE") or default_cache_dir() / "prepared")


def _key(**settings) -> str:
    return hashlib.sha256(json.dumps({**settings, "code": code_version()}, sort_keys=True).encode()).hexdigest()[:16]


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished entry into place; a concurrent run that got there first wins (same key, same content)."""
    try:
        tmp.rename(final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def refuse_config_only(model) -> None:
    """Raise the one-line ModelFormatError of a model known by its config.json alone (no weights: nothing to
    calibrate or quantize), before anything is said or written."""
    if (getattr(model, "meta", None) or {}).get("format") == "config":
        raise model.tokenizer.error()  # hf_loader._NoWeights: names the file and what the command needs


def calibration(model, progress: bool = False, say=None, tokens: int = CALIB_TOKENS, window: int = CALIB_WINDOW):
    """The activation profile (OutlierStats) of `model` on the first `tokens` training-corpus tokens, cached."""
    from .corpus import read_corpus
    from .profile import OutlierStats
    from .quant import calibration_profile

    refuse_config_only(model)
    say = say or (lambda m: None)
    window = min(window, tokens)
    path = cache_root() / f"calib-{Path(model.name).name}-{_key(model=model.sha256, tokens=tokens, window=window)}.npz"
    if path.exists():
        try:
            return OutlierStats.load(path)
        except Exception:  # noqa: BLE001  (a damaged cache entry is recomputed, not trusted)
            path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    say(f"calibrating {model.name} on {tokens} training-corpus tokens (activation clips; cached for later runs)…")
    prof = calibration_profile(model, model.tokenizer.encode(read_corpus("train")), tokens=tokens, window=window,
                               progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{time.time_ns()}.npz")
    prof.save(tmp)
    tmp.replace(path)
    say(f"calibrated in {time.perf_counter() - t0:.1f} s")
    return prof


def prepared(model, scheme: str, progress: bool = False, say=None, prune_rate: float = 0.85, coverage: float = 0.8,
             tolerance: float = 0.05, calib_tokens: int = CALIB_TOKENS, expert_bits=None,
             calib_window: int = CALIB_WINDOW):
    """`model` quantized under `scheme` (a QuantizedModel), from the cache when an earlier run prepared the same.
    The one place the demo, the CLI (run, schedule, eval, quantize) and the Python API calibrate and quantize."""
    from .quant import QuantizedModel, quantize
    from .quant.schemes import NEEDS_PROFILE

    refuse_config_only(model)
    say = say or (lambda m: None)
    if scheme == "float":  # nothing to calibrate or quantize: a float copy on disk would only cost space
        return quantize(model, scheme, None)
    needs_profile = scheme in NEEDS_PROFILE
    settings = {"model": model.sha256, "scheme": scheme, "prune_rate": round(prune_rate, 6),
                "coverage": round(coverage, 6)}
    if needs_profile:
        settings.update(calib_tokens=calib_tokens, calib_window=min(calib_window, calib_tokens))
    if scheme == "moe-mixed":
        settings["tolerance"] = round(tolerance, 6)
    folder = cache_root() / f"{Path(model.name).name}-{scheme}-{_key(**settings)}"
    if (folder / "manifest.json").exists():
        t0 = time.perf_counter()
        try:
            qm = QuantizedModel.load(folder)
        except Exception:  # noqa: BLE001  (damaged: prepare again below)
            shutil.rmtree(folder, ignore_errors=True)
        else:
            say(f"reusing {scheme} of {model.name} prepared earlier ({qm.nbytes()['total'] / 1e6:.0f} MB, loaded in "
                f"{time.perf_counter() - t0:.1f} s from {folder})")
            return qm
    t0 = time.perf_counter()
    profile = calibration(model, progress, say, calib_tokens, calib_window) if needs_profile else None
    t1 = time.perf_counter()
    say(f"quantizing {model.name} to {scheme} (once; cached for later runs)…")
    if scheme == "moe-mixed" and expert_bits is None:
        from .corpus import read_corpus
        from .quant.expert_bits import ExpertBitsStudy

        study = ExpertBitsStudy(model, model.tokenizer.encode(read_corpus("train")),
                                window=min(256, model.config.context_length), max_windows=4, progress=progress)
        expert_bits = study.select(tolerance).bits
    qm = quantize(model, scheme, profile, prune_rate=prune_rate, coverage=coverage, expert_bits=expert_bits)
    tmp = folder.with_name(f".{folder.name}.{time.time_ns()}.tmp")
    qm.save(tmp)
    _publish(tmp, folder)
    say(f"prepared {scheme} in {time.perf_counter() - t0:.1f} s (quantization {time.perf_counter() - t1:.1f} s, "
        f"{qm.nbytes()['total'] / 1e6:.0f} MB), cached in {folder}")
    return qm
