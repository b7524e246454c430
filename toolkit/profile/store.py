"""Saved profiles: one .npz per profile, arrays plus a JSON metadata record.

File format (version 1), a NumPy .npz archive (zip) holding:
  __meta__          uint8[]: UTF-8 JSON with
                      format "edgeprobe-stats", format_version 1, kind ("outliers" | "sparsity"),
                      edgeprobe_version, model {name, sha256}, corpus_sha256 [sha256 of the int32 token
                      ids of every shard profiled], tokens, windows, params {kind-specific thresholds
                      and settings}
  "<tensor>|<field>" one array per tensor and field (e.g. "blk.3.ffn_act|count"), as documented by
                      the profile class's FIELDS.
Merging adds counts and takes maxima, so a merged file equals one pass over all shards. The same bytes carry a
shard's profile between a Ray worker and the driver (npz_bytes / load_npz of bytes): no pickled objects.
"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np

from .. import __version__
from ..errors import StatsFileError

FORMAT = "edgeprobe-stats"
FORMAT_VERSION = 1


def _write_npz(f, meta: dict, arrays: dict[str, dict[str, np.ndarray]]) -> None:
    flat = {f"{t}|{f}": a for t, fields in arrays.items() for f, a in fields.items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "edgeprobe_version": __version__, **meta}
    flat["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(f, **flat)


def save_npz(path, meta: dict, arrays: dict[str, dict[str, np.ndarray]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        _write_npz(f, meta, arrays)
    tmp.replace(path)  # atomic: never a half-written profile under the real name
    return path


def npz_bytes(meta: dict, arrays: dict[str, dict[str, np.ndarray]]) -> bytes:
    """The file save_npz writes, as bytes (a shard's result crossing from a Ray worker)."""
    buf = io.BytesIO()
    _write_npz(buf, meta, arrays)
    return buf.getvalue()


def load_npz(path, kind: str) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """path: a file, or the bytes npz_bytes made (then errors call it "a profile's bytes")."""
    if isinstance(path, (bytes, bytearray, memoryview)):
        source, path = io.BytesIO(path), f"a profile's bytes ({len(path)} B)"
    else:
        path = source = Path(path)
        if not path.exists():
            raise StatsFileError(f"no profile at {path}; run `edgeprobe profile {kind} ... --out DIR` first")
    try:
        with np.load(source, allow_pickle=False) as z:
            meta = json.loads(bytes(z["__meta__"]).decode())
            flat = {k: z[k] for k in z.files if k != "__meta__"}
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError, json.JSONDecodeError) as e:
        raise StatsFileError(f"{path} is not a readable edgeprobe profile ({type(e).__name__}: {e}); "
                             "it is damaged or not a profile: profile the model again") from e
    if meta.get("format") != FORMAT:
        raise StatsFileError(f"{path} is not an edgeprobe profile (format {meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise StatsFileError(f"{path} has profile format version {meta.get('format_version')}, this edgeprobe "
                             f"reads version {FORMAT_VERSION}; profile the model again with this version")
    if meta.get("kind") != kind:
        raise StatsFileError(f"{path} holds a {meta.get('kind')!r} profile, not {kind!r}; "
                             f"load it with the matching class")
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for key, a in flat.items():
        t, _, f = key.partition("|")
        arrays.setdefault(t, {})[f] = a
    return meta, arrays


def ids_sha256(ids: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int32).tobytes()).hexdigest()

