"""Content-addressed blobs: raw array bytes named by their sha256, described in the manifest."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ..errors import ManifestError


def sha256_bytes(b) -> str:
    return hashlib.sha256(b).hexdigest()


class BlobStore:
    """sha256 -> array. `put` stores an array's raw bytes once (same bytes, same blob); `meta[sha]` holds
    dtype and shape so the bytes come back as the same array.

    In memory by default. With `folder`, each blob is written there as it is put (the layout `write` makes) and
    not kept: `get` reads it back from its file (the page cache's to keep or drop), so a quantizer's memory is one
    tensor's at a time, not the model's (issue 43: an 8B model's blobs are ~9 GB). Files are read, not memory-mapped:
    a map holds a file descriptor per blob, and a process holds several models of hundreds of blobs."""

    def __init__(self, folder: Path | None = None):
        self.arrays: dict[str, np.ndarray] = {}
        self.meta: dict[str, dict] = {}
        self.folder = Path(folder) if folder is not None else None
        self._spill = folder is not None

    def seal(self, folder: Path) -> None:
        """The blobs written so far now live in `folder` (the entry was moved there, e.g. published from a
        temporary name); blobs put from now on are kept in memory, so the folder is never written again."""
        self.folder, self._spill = Path(folder), False

    def put(self, arr: np.ndarray, role: str) -> str:
        arr = np.ascontiguousarray(arr)
        sha = sha256_bytes(arr.reshape(-1).view(np.uint8))  # the raw bytes, hashed in place (no copy)
        if sha not in self.meta:
            if self._spill:
                _write_blob(self.folder, sha, arr)
            else:
                self.arrays[sha] = arr
            self.meta[sha] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "nbytes": int(arr.nbytes), "role": role}
        return sha

    def get(self, sha: str) -> np.ndarray:
        arr = self.arrays.get(sha)
        if arr is not None:
            return arr
        m = self.meta.get(sha)
        if m is None or self.folder is None:
            raise ManifestError(f"blob {sha[:16]}… is not in this quantized model; it is incomplete: "
                                "quantize again or copy the missing blob")
        try:
            arr = np.fromfile(self.folder / sha, dtype=np.dtype(m["dtype"]))
        except OSError as e:
            raise ManifestError(f"blob {sha[:16]}… of this quantized model cannot be read from {self.folder} "
                                f"({e.strerror or e}); quantize again") from None
        if arr.size != int(np.prod(m["shape"], dtype=np.int64)):
            raise ManifestError(f"blob {sha[:16]}… in {self.folder} has {arr.nbytes} bytes, its manifest entry says "
                                f"{m['shape']} of {m['dtype']}; quantize again")
        arr.flags.writeable = False  # as a blob held in memory is shared: nobody writes into it
        return arr.reshape(m["shape"])

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for sha in self.meta:
            path = folder / sha
            if sha in self.arrays or not (path.exists() and path.stat().st_size == self.meta[sha]["nbytes"]):
                _write_blob(folder, sha, self.get(sha))

    @classmethod
    def read(cls, folder: Path, meta: dict[str, dict], verify: bool = True) -> "BlobStore":
        store = cls()
        for sha, m in meta.items():
            path = folder / sha
            if not path.exists():
                raise ManifestError(f"blob {sha[:16]}… ({m.get('role')}) listed in the manifest is missing from "
                                    f"{folder}; copy it back or quantize again")
            raw = path.read_bytes()
            if verify and sha256_bytes(raw) != sha:
                raise ManifestError(f"blob {sha[:16]}… in {folder} fails its sha256 check (damaged); "
                                    "copy it again or quantize again")
            dtype = np.dtype(m["dtype"])
            if len(raw) != int(np.prod(m["shape"], dtype=np.int64)) * dtype.itemsize:
                raise ManifestError(f"blob {sha[:16]}… has {len(raw)} bytes, its manifest entry says "
                                    f"{m['shape']} of {m['dtype']}")
            store.arrays[sha] = np.frombuffer(raw, dtype=dtype).reshape(m["shape"])
            store.meta[sha] = m
        return store


def _write_blob(folder: Path, sha: str, arr: np.ndarray) -> Path:
    """folder/sha holding arr's raw bytes, written to a temporary name and renamed (a reader never sees half)."""
    path = folder / sha
    if path.exists() and path.stat().st_size == arr.nbytes:
        return path  # content-addressed: an existing blob of that name is that content
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{sha}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)  # no bytes copy of the array
    os.replace(tmp, path)
    return path
