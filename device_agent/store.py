"""The agent's blob store on "flash" (a directory): content-addressed, resumable, verified, budgeted.

Layout under the store root:
    blobs/<sha256>            the raw array bytes, named by their sha256
    blobs/<sha256>.json       {"dtype", "shape"}
    partial/<sha256>.part     an upload in progress, preallocated to its full size
    partial/<sha256>.json     {"dtype", "shape", "nbytes", "n_chunks", "chunk_bytes", "have": [chunk indices]}
Writes go to a temporary file and are renamed into place, so a crash never leaves a half blob under
its real name; a finished upload is re-hashed before it is renamed. Reads keep arrays resident in
memory up to `memory_budget` bytes, evicting the least recently used; every read from flash is
reported to `on_read(event)` with its bytes and time (EdgeMoE experts and cold shadow rows use this).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

_HEX = set("0123456789abcdef")


class StoreError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def check_sha(sha) -> str:
    if not isinstance(sha, str) or len(sha) != 64 or not set(sha) <= _HEX:
        raise StoreError("bad_sha", f"blob id {str(sha)[:70]!r} is not a lowercase hex sha256")
    return sha


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def now_us() -> float:
    """The agent clock: monotonic microseconds (trace events and hello use it)."""
    return time.perf_counter_ns() / 1000.0


class FlashStore:
    def __init__(self, root, memory_budget: int | None = None, on_read=None):
        self.root = Path(root)
        self.blob_dir, self.part_dir = self.root / "blobs", self.root / "partial"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.part_dir.mkdir(parents=True, exist_ok=True)
        self.memory_budget = memory_budget
        self.on_read = on_read
        self._resident: OrderedDict[str, np.ndarray] = OrderedDict()
        self._resident_bytes = 0
        self._lock = threading.RLock()
        self.reads = self.read_bytes = 0

    # ---- what is here -------------------------------------------------------------------------
    def has(self, sha: str) -> bool:
        return (self.blob_dir / check_sha(sha)).exists() and (self.blob_dir / f"{sha}.json").exists()

    def partial_chunks(self, sha: str) -> list[int]:
        meta = self._part_meta(check_sha(sha))
        return sorted(meta["have"]) if meta else []

    def _part_meta(self, sha: str) -> dict | None:
        p = self.part_dir / f"{sha}.json"
        if not p.exists() or not (self.part_dir / f"{sha}.part").exists():
            return None
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None  # a damaged sidecar: the upload starts over

    # ---- upload -------------------------------------------------------------------------------
    def put_chunk(self, sha: str, dtype: str, shape: list, nbytes: int, index: int, n_chunks: int,
                  chunk_bytes: int, chunk_sha: str, data) -> bool:
        """Write chunk `index` of blob `sha` (checked against `chunk_sha`); True once the blob is complete."""
        check_sha(sha)
        data = memoryview(data).cast("B")
        if hashlib.sha256(data).hexdigest() != chunk_sha:
            raise StoreError("chunk_checksum", f"chunk {index} of {sha[:12]} does not match its sha256; send it again")
        if np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)) != nbytes:
            raise StoreError("bad_blob", f"blob {sha[:12]}: dtype {dtype} and shape {shape} do not make {nbytes} bytes")
        if not (isinstance(n_chunks, int) and n_chunks == max(1, -(-nbytes // chunk_bytes)) and 0 <= index < n_chunks):
            raise StoreError("bad_chunk", f"chunk {index} of {n_chunks} does not fit a {nbytes}-byte blob in "
                                          f"{chunk_bytes}-byte chunks")
        start = index * chunk_bytes
        if len(data) != min(chunk_bytes, nbytes - start) and nbytes:
            raise StoreError("bad_chunk", f"chunk {index} of {sha[:12]} has {len(data)} bytes, expected "
                                          f"{min(chunk_bytes, nbytes - start)}")
        with self._lock:
            if self.has(sha):
                return True
            meta = self._part_meta(sha)
            spec = {"dtype": dtype, "shape": list(shape), "nbytes": nbytes, "n_chunks": n_chunks, "chunk_bytes": chunk_bytes}
            part = self.part_dir / f"{sha}.part"
            if meta is None or any(meta.get(k) != v for k, v in spec.items()):
                with open(part, "wb") as f:
                    f.truncate(nbytes)
                meta = {**spec, "have": []}
            fd = os.open(part, os.O_WRONLY)
            try:
                os.pwrite(fd, data, start)
                os.fsync(fd)
            finally:
                os.close(fd)
            have = set(meta["have"]) | {index}
            meta["have"] = sorted(have)
            _atomic_write(self.part_dir / f"{sha}.json", json.dumps(meta).encode())
            if len(have) < n_chunks:
                return False
            digest = _file_sha256(part)
            if digest != sha:
                part.unlink(missing_ok=True)
                (self.part_dir / f"{sha}.json").unlink(missing_ok=True)
                raise StoreError("blob_checksum", f"blob {sha[:12]} reassembled to sha256 {digest[:12]}; upload it again")
            _atomic_write(self.blob_dir / f"{sha}.json", json.dumps({"dtype": dtype, "shape": list(shape)}).encode())
            os.replace(part, self.blob_dir / sha)
            (self.part_dir / f"{sha}.json").unlink(missing_ok=True)
            return True

    # ---- reads --------------------------------------------------------------------------------
    def get(self, sha: str) -> np.ndarray:
        """The blob as a read-only array; from memory if resident, else read from flash (an event)."""
        with self._lock:
            a = self._resident.get(sha)
            if a is not None:
                self._resident.move_to_end(sha)
                return a
        if not self.has(sha):
            raise StoreError("missing_blob", f"blob {str(sha)[:12]} is not in the store; upload it first")
        meta = json.loads((self.blob_dir / f"{sha}.json").read_text())
        t0 = now_us()
        with open(self.blob_dir / sha, "rb") as f:
            raw = f.read()
        t1 = now_us()
        a = np.frombuffer(raw, dtype=meta["dtype"]).reshape(meta["shape"])
        with self._lock:
            self.reads += 1
            self.read_bytes += a.nbytes
            if self.memory_budget is None or a.nbytes <= self.memory_budget:
                self._resident[sha] = a
                self._resident_bytes += a.nbytes
                while self.memory_budget is not None and self._resident_bytes > self.memory_budget:
                    _, old = self._resident.popitem(last=False)
                    self._resident_bytes -= old.nbytes
        if self.on_read:
            self.on_read({"name": f"read {sha[:8]}", "kind": "flash_read", "lane": "io", "start_us": t0, "end_us": t1,
                          "bytes_in": a.nbytes, "bytes_out": 0, "flops": 0, "emulated": False, "blob": sha})
        return a

    def stats(self) -> dict:
        blobs = [p for p in self.blob_dir.iterdir() if len(p.name) == 64]
        return {"blobs": len(blobs), "bytes": sum(p.stat().st_size for p in blobs),
                "partial": len(list(self.part_dir.glob("*.part"))), "resident_bytes": self._resident_bytes,
                "memory_budget": self.memory_budget, "reads": self.reads, "read_bytes": self.read_bytes}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()
