"""The store's reads: blobs kept resident up to a memory budget (least recently used evicted), mapped whole from
flash, rows read past the page cache, or mapped without reading; each read from flash is reported as a flash_read
event to the `on_read` the read was called with (the agent passes each run's own), else to the store's.
"""
from __future__ import annotations

import mmap
import os
from collections import OrderedDict

import numpy as np

from .files import StoreError, _map_whole, now_us


class Reads:
    """FlashStore's read side (a mixin: FlashStore gives it meta(), blob_dir and _lock)."""

    def _init_reads(self, memory_budget: int | None, on_read) -> None:
        self.memory_budget = memory_budget
        self.on_read = on_read
        self._resident: OrderedDict[str, np.ndarray] = OrderedDict()
        self._resident_bytes = 0
        self.reads = self.read_bytes = 0
        self._mapped: dict = {}     # sha -> read-only memory map of a finished blob (map)

    def get(self, sha: str, on_read=None) -> np.ndarray:
        """The blob as a read-only array; from memory if resident, else read from flash (an event to on_read): mapped
        and paged in at once (MAP_POPULATE), which shares the OS's page cache instead of copying it into fresh memory
        (a 28 MB head blob: ~15 ms copied, a third of that mapped; llama.cpp maps its weights the same way)."""
        with self._lock:
            a = self._resident.get(sha)
            if a is not None:
                self._resident.move_to_end(sha)
                return a
        meta = self.meta(sha)
        t0 = now_us()
        raw = _map_whole(self.blob_dir / sha)
        if raw is None:  # an empty blob (nothing to map)
            with open(self.blob_dir / sha, "rb") as f:
                raw = f.read()
        t1 = now_us()
        a = np.frombuffer(raw, dtype=meta["dtype"]).reshape(meta["shape"])
        with self._lock:
            if self.memory_budget is None or a.nbytes <= self.memory_budget:
                self._resident[sha] = a
                self._resident_bytes += a.nbytes
                while self.memory_budget is not None and self._resident_bytes > self.memory_budget:
                    _, old = self._resident.popitem(last=False)
                    self._resident_bytes -= old.nbytes
        self._traced(on_read, f"read {sha[:8]}", sha, t0, t1, a.nbytes)
        return a

    def read_rows(self, sha: str, rows, cold: bool = True, lane: str = "io", on_read=None) -> np.ndarray:
        """Rows `rows` (int array, first axis) of a blob read straight from its file — one pread per run of
        consecutive rows, never kept resident. cold: afterwards drop those pages from the OS page cache
        (posix_fadvise DONTNEED), so reading them again goes to the device, as on a phone whose DRAM cannot
        hold the weights. Traced as flash_read events on `lane`."""
        meta = self.meta(sha)
        shape, dt = meta["shape"], np.dtype(meta["dtype"])
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
        rows = np.asarray(rows, np.int64)
        out = np.empty((len(rows),) + tuple(shape[1:]), dt)
        if len(rows) == 0:
            return out
        if rows.min() < 0 or rows.max() >= shape[0]:
            raise StoreError("bad_rows", f"rows outside [0, {shape[0]}) of blob {sha[:12]}")
        order = np.argsort(rows, kind="stable")
        srt = rows[order]
        breaks = np.nonzero(np.diff(srt) != 1)[0] + 1
        t0 = now_us()
        fd = os.open(self.blob_dir / sha, os.O_RDONLY)
        try:
            flat = out.reshape(len(rows), -1).view(np.uint8)
            for run in np.split(np.arange(len(srt)), breaks):
                first, n = int(srt[run[0]]), len(run)
                raw = os.pread(fd, n * row_bytes, first * row_bytes)
                flat[order[run]] = np.frombuffer(raw, np.uint8).reshape(n, row_bytes)
                if cold and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, first * row_bytes, n * row_bytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        self._traced(on_read, f"read {sha[:8]} rows", sha, t0, now_us(), len(rows) * row_bytes, lane,
                     runs=len(breaks) + 1)
        return out

    def map(self, sha: str) -> np.ndarray:
        """The blob memory-mapped read-only: nothing is read now; the rows a kernel touches are paged in from flash
        then (the shadow outliers' cold rows, of which a run reads ~1%; llama.cpp maps its weights the same way)."""
        with self._lock:
            a = self._mapped.get(sha)
        if a is not None:
            return a
        meta = self.meta(sha)
        n = int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize
        if n == 0:
            return self.get(sha)
        with open(self.blob_dir / sha, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        a = np.frombuffer(mm, dtype=meta["dtype"], count=n // np.dtype(meta["dtype"]).itemsize).reshape(meta["shape"])
        with self._lock:
            return self._mapped.setdefault(sha, a)

    def read_cold(self, sha: str, lane: str = "io", on_read=None) -> np.ndarray:
        """A whole blob read from flash without keeping it resident, pages dropped after (see read_rows)."""
        shape = self.meta(sha)["shape"]
        if not shape:
            return self.get(sha, on_read)
        return self.read_rows(sha, np.arange(shape[0]), lane=lane, on_read=on_read)

    def _traced(self, on_read, name: str, sha: str, t0: float, t1: float, nbytes: int, lane: str = "io",
                **extra) -> None:
        """Count a read from flash and report it as a flash_read event to on_read, else to the store's on_read."""
        with self._lock:
            self.reads += 1
            self.read_bytes += nbytes
        report = on_read or self.on_read
        if report:
            report({"name": name, "kind": "flash_read", "lane": lane, "start_us": t0, "end_us": t1, "bytes_in": nbytes,
                    "bytes_out": 0, "flops": 0, "emulated": False, "blob": sha, **extra})
