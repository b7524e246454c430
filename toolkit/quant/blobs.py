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
    dtype and shape so the bytes come back as the same array."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self.meta: dict[str, dict] = {}

    def put(self, arr: np.ndarray, role: str) -> str:
        arr = np.ascontiguousarray(arr)
        sha = sha256_bytes(arr.reshape(-1).view(np.uint8))  # the raw bytes, hashed in place (no copy)
        if sha not in self.arrays:
            self.arrays[sha] = arr
            self.meta[sha] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "nbytes": int(arr.nbytes), "role": role}
        return sha

    def get(self, sha: str) -> np.ndarray:
        try:
            return self.arrays[sha]
        except KeyError:
            raise ManifestError(f"blob {sha[:16]}… is not in this quantized model; it is incomplete: "
                                "quantize again or copy the missing blob") from None

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for sha, arr in self.arrays.items():
            path = folder / sha
            if path.exists() and path.stat().st_size == arr.nbytes:
                continue  # content-addressed: an existing blob of that name is that content
            tmp = folder / f".{sha}.{os.getpid()}.tmp"
            tmp.write_bytes(arr.tobytes())
            os.replace(tmp, path)

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
