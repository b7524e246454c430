"""The agent's blob store on "flash" (a directory): content-addressed, resumable, verified, budgeted.

Under the store root:
    blobs/<sha256>            the raw array bytes, named by their sha256
    blobs/index.jsonl         one {"sha", "dtype", "shape"} line per committed blob
    blobs/<sha256>.json       {"dtype", "shape"} of a blob stored by an older agent (still read)
    partial/<sha256>.part     an upload in progress, preallocated to its full size
    partial/<sha256>.json     {"dtype", "shape", "nbytes", "n_chunks", "chunk_bytes", "have": [chunk indices]}
    layouts/pack              blobs in the layouts kernels read, appended at page-aligned offsets (layouts.py)
    layouts/pack.jsonl        one {"key": "<sha256>.<tag>", "offset", "nbytes"} line per layout in the pack
    layouts/<sha256>.<tag>    a layout an older agent kept in a file of its own (still read)
A blob gets its real name only once its sha256 matches and its bytes and index line are fsynced, so a crash never
leaves a half or unverified blob under it (upload.py). Reads keep arrays resident up to `memory_budget` bytes and
report every read from flash (cache.py). One module per part: upload, cache (reads), layouts, files (helpers).
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from .cache import Reads
from .files import StoreError, _lock_store, _open_jsonl, _unlock_store, check_sha, now_us
from .layouts import Layouts
from .upload import Uploads

__all__ = ["FlashStore", "StoreError", "check_sha", "now_us"]

INDEX = "index.jsonl"


class FlashStore(Uploads, Reads, Layouts):
    """The store: its folders, its lock (one agent per store) and the index of finished blobs; uploads, reads and
    layouts come from the parts it is made of."""

    def __init__(self, root, memory_budget: int | None = None, on_read=None, lock_wait_s: float = 10.0):
        self.root = Path(root)
        self.blob_dir, self.part_dir = self.root / "blobs", self.root / "partial"
        self._blob_dir_s = str(self.blob_dir)
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.part_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock_store(self.root, lock_wait_s)  # one agent per store: uploads must not interleave
        self._lock = threading.RLock()
        self._sidecars: dict = {}   # sha -> {"dtype", "shape"} of finished blobs (the index; written under _lock)
        self._index = self._open_index()
        self._init_reads(memory_budget, on_read)
        self._init_uploads()
        self._init_layouts()

    # ---- what is here -------------------------------------------------------------------------
    def has(self, sha: str) -> bool:
        return self._present(sha) is not None

    def meta(self, sha: str) -> dict:
        """{"dtype", "shape"} of a finished blob, without reading or mapping it."""
        m = self._present(sha)
        if m is None:
            raise StoreError("missing_blob", f"blob {str(sha)[:12]} is not in the store; upload it first")
        return m

    def _present(self, sha: str) -> dict | None:
        """A finished blob's {"dtype", "shape"} if its file is here, else None."""
        # a string path, not a Path: a model's load and its first plan ask this ~700 times (Path: ~15 us each)
        return self._meta_of(sha) if os.path.exists(os.path.join(self._blob_dir_s, check_sha(sha))) else None

    def _meta_of(self, sha: str) -> dict | None:
        """{"dtype", "shape"} of a finished blob: from the index, else the sidecar an older agent wrote, else None."""
        with self._lock:
            m = self._sidecars.get(sha)
        if m is None:
            try:
                m = json.loads((self.blob_dir / f"{sha}.json").read_text())
            except (OSError, ValueError):
                return None
            with self._lock:
                self._sidecars[sha] = m
        return m

    def _open_index(self):
        """Read blobs/index.jsonl and open it for appending (the upload's commits append to it)."""
        records, f = _open_jsonl(self.blob_dir / INDEX)
        for rec in records:
            try:
                self._sidecars[check_sha(rec["sha"])] = {"dtype": rec["dtype"], "shape": rec["shape"]}
            except (KeyError, TypeError, StoreError):
                continue
        return f

    def close(self) -> None:
        """Finish every queued chunk write (and its sidecar) and layout before the process exits: the worker threads
        are daemons, so an agent told to stop right after a put_blob would otherwise lose the last chunks."""
        self._drain()  # the queues are FIFO: a marker behind every chunk of every upload
        self._close_layouts()

    def unlock(self) -> None:
        """Release the store to the next agent, its pid cleared from the lock file; the last thing a stopping
        agent does."""
        if not self._lock_file.closed:
            _unlock_store(self._lock_file)

    def stats(self) -> dict:
        blobs = [p for p in self.blob_dir.iterdir() if len(p.name) == 64]
        return {"blobs": len(blobs), "bytes": sum(p.stat().st_size for p in blobs),
                "partial": len(list(self.part_dir.glob("*.part"))), "resident_bytes": self._resident_bytes,
                "memory_budget": self.memory_budget, "reads": self.reads, "read_bytes": self.read_bytes}
