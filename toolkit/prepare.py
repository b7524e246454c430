"""Quantized models prepared once and reused across command lines: the calibration profile and the quantized
model, cached in $EDGEPROBE_PREPARED_CACHE, else in `prepared/` of the edgeprobe cache ($EDGEPROBE_CACHE, else
~/.cache/edgeprobe).

    qm = prepared(model, "w8a8-shadow", say=print)   # first call: calibrate + quantize (~40 s), then ~1 s

A cache entry is keyed by the model's sha256, the scheme, every setting that changes the result (calibration
tokens, window, percentile, prune rate, coverage, moe-mixed tolerance) and a hash of the quantizer's and kernels'
source, so an edit to either prepares again instead of reusing stale blobs. Entries are written to a temporary
folder and renamed into place: an interrupted run or two runs preparing at once never leave half an entry.
Each step says what it prepares and how long it took, one line each, through `say`.

Entries are never replaced in place, so a code change leaves the old ones behind: each records the code version it
was prepared under (a "prepared" field in the manifest, or in a calibration's .npz metadata), `cache_entries()`
lists them as current or stale and `prune()` removes the stale ones (`edgeprobe cache list|prune`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import zipfile
from functools import lru_cache
from pathlib import Path

CALIB_TOKENS = 4096   # training-corpus tokens the activation clips are calibrated on (quant.calibration_profile)
CALIB_WINDOW = 512
_KEYED = re.compile(r"-[0-9a-f]{16}$")  # the names prepared() and calibration() give: <model>[-<scheme>]-<_key>
TEMP_GRACE_S = 3600   # a temporary entry modified within this long may still be being written: never pruned


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
    from .profile.store import save_npz
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
    # prof.save(tmp), its metadata also naming the code version it was computed under (read by cache_entries)
    save_npz(tmp, {**prof._meta(), "prepared": {"code_version": code_version(), "tokens": tokens, "window": window}},
             prof.arrays)
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
    tmp = folder.with_name(f".{folder.name}.{time.time_ns()}.tmp")
    try:  # blobs written into the temporary entry as they are made: memory holds one tensor, not the model
        qm = quantize(model, scheme, profile, prune_rate=prune_rate, coverage=coverage, expert_bits=expert_bits,
                      out=tmp)
        qm.manifest["prepared"] = {"code_version": code_version(), "settings": settings}  # read by cache_entries
        qm.save(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted or failed quantization leaves no half entry
        raise
    _publish(tmp, folder)
    qm.store.seal(folder / "blobs")  # read back from the published entry (the same bytes if another run won)
    say(f"prepared {scheme} in {time.perf_counter() - t0:.1f} s (quantization {time.perf_counter() - t1:.1f} s, "
        f"{qm.nbytes()['total'] / 1e6:.0f} MB), cached in {folder}")
    return qm


def _tree(path: Path) -> tuple[int, float]:
    """(bytes of the files under `path`, or of `path` itself; the newest mtime among them), 0 for what vanished."""
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    size, newest = 0, 0.0
    for p in paths:
        try:
            st = p.lstat()
        except OSError:  # removed while we looked (a run publishing or pruning at the same time)
            continue
        size += st.st_size if not p.is_dir() else 0
        newest = max(newest, st.st_mtime)
    return size, newest


def _recorded(path: Path) -> dict | None:
    """The JSON object at `path` (a manifest), or in a calibration .npz's __meta__; None if missing or unreadable."""
    import numpy as np

    try:
        if path.suffix == ".npz":
            with zipfile.ZipFile(path) as z:  # that member alone: the profile's arrays stay unread
                doc = json.loads(np.lib.format.read_array(z.open("__meta__.npy")).tobytes())
        else:
            doc = json.loads(path.read_text())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    return doc if isinstance(doc, dict) else None


def cache_entries(root: Path | None = None, now: float | None = None) -> list[dict]:
    """Every entry under `root` (default cache_root()), sorted by path: one dict each with
    path, name, kind ("model": a quantized model folder; "calibration": an activation profile; "temp": one being
    written or left by an interrupted run), model, scheme (None for a calibration or temp), bytes, modified (epoch
    seconds of its newest file), code_version (recorded, None if not), state and stale.
    state: "current" (prepared under today's code_version()), "stale" (an older code version), "unrecorded" (from
    before entries recorded their code version, or unreadable: counted stale), "incomplete" (a model folder without
    a readable manifest: counted stale), "writing" (a temp modified within TEMP_GRACE_S: never pruned) or
    "abandoned" (an older temp: stale).
    Files edgeprobe did not write are left out."""
    root = Path(root) if root is not None else cache_root()
    now = time.time() if now is None else now
    if root.exists() and not root.is_dir():
        from .errors import EdgeprobeError

        raise EdgeprobeError(f"the prepared-model cache {root} is a file, not a folder; remove it or point "
                             "$EDGEPROBE_PREPARED_CACHE elsewhere")
    try:
        children = sorted(root.iterdir())
    except FileNotFoundError:
        return []
    today = code_version()
    out = []
    for p in children:
        name = p.name
        incomplete = False
        if name.startswith("."):  # ".<entry>.<ns>.tmp" folders, ".calib-….<ns>.npz[.tmp]" files
            kind, model, scheme, version = "temp", None, None, None
        elif p.is_dir() and _KEYED.search(name):
            kind = "model"
            m = _recorded(p / "manifest.json")
            incomplete = m is None
            rec = (m or {}).get("prepared")
            version = rec.get("code_version") if isinstance(rec, dict) else None
            model = ((m or {}).get("model") or {}).get("name") or name.rsplit("-", 1)[0]
            scheme = (m or {}).get("scheme")
        elif name.startswith("calib-") and name.endswith(".npz") and _KEYED.search(name[:-4]):
            kind, scheme = "calibration", None
            rec = (_recorded(p) or {}).get("prepared")
            version = rec.get("code_version") if isinstance(rec, dict) else None
            model = name[len("calib-"):].rsplit("-", 1)[0]
        else:
            continue  # not something prepare.py writes
        size, modified = _tree(p)
        if kind == "temp":
            state = "writing" if now - modified < TEMP_GRACE_S else "abandoned"
        elif incomplete:
            state = "incomplete"
        else:
            state = "unrecorded" if version is None else "current" if version == today else "stale"
        out.append({"path": str(p), "name": name, "kind": kind, "model": model, "scheme": scheme, "bytes": size,
                    "modified": modified, "code_version": version, "state": state,
                    "stale": state not in ("current", "writing")})
    return out


def _remove(path: Path) -> None:
    """Remove an entry so that an interruption leaves no loadable half: a model's manifest goes first."""
    if path.is_dir():
        (path / "manifest.json").unlink(missing_ok=True)
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def prune(all: bool = False, dry_run: bool = False, root: Path | None = None, now: float | None = None) -> list[dict]:
    """Remove the stale entries of cache_entries() (every entry with all=True), never a temp still being written.
    Returns the entries removed (with dry_run, those that would be, nothing touched); their "bytes" sum is what was
    freed. An entry that cannot be removed raises EdgeprobeError naming it, after the ones before it are gone."""
    from .errors import EdgeprobeError

    doomed = [e for e in cache_entries(root, now) if e["state"] != "writing" and (all or e["stale"])]
    if dry_run:
        return doomed
    for i, e in enumerate(doomed):
        try:
            _remove(Path(e["path"]))
        except OSError as err:
            freed = sum(d["bytes"] for d in doomed[:i])
            raise EdgeprobeError(f"could not remove {e['path']} ({err.strerror or err}); removed {i} entries "
                                 f"({freed} bytes) before it") from err
    return doomed
