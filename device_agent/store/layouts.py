"""The store's pack of layouts: blobs in the layouts kernels read (e.g. "rows": an int8 weight transposed), made from
the verified blobs the first time a run needs them and appended to layouts/pack between runs, so the next agent
process on this store reads them instead of preparing them again (as a phone's runtime keeps its prepared graphs).
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading

import numpy as np

from .files import PAGE, StoreError, _map_whole, _open_jsonl, _populate_at, _read_whole, now_us

LAYOUT_PIECE = 4 << 20  # a layout is written in pieces of this many bytes, each between runs
PACK = "pack"       # the store's layouts, one file mapped once (see Layouts.layout)


class Layouts:
    """FlashStore's layouts (a mixin: FlashStore gives it has(), root, _lock and _traced)."""

    def _init_layouts(self) -> None:
        self.layout_dir = self.root / "layouts"
        self.layout_dir.mkdir(exist_ok=True)
        for tmp in self.layout_dir.glob("*.tmp"):  # a layout being written when an agent stopped: made again on use
            tmp.unlink(missing_ok=True)
        self._open_pack()
        self._layout_q: queue.Queue = queue.Queue()
        self._idle = threading.Condition()  # _runs: runs in flight (running()); _closing: write now, whatever runs
        self._runs, self._closing = 0, False
        threading.Thread(target=self._layout_worker, daemon=True, name="layout-writer").start()

    def _close_layouts(self) -> None:
        """Write every queued layout now, whatever runs (the process is stopping)."""
        with self._idle:
            self._closing = True
            self._idle.notify_all()
        self.flush_layouts()

    def flush_layouts(self, timeout: float | None = None) -> bool:
        """Wait until every layout queued so far is in flash (True), or timeout seconds (False)."""
        ev = threading.Event()
        self._layout_q.put((None, ev))
        return ev.wait(timeout)

    def layout(self, sha: str, tag: str, shape: tuple, dtype, make, empty=np.empty, on_read=None,
               into: np.ndarray | None = None) -> np.ndarray:
        """Blob sha in the layout `tag` that a kernel reads (shape, dtype): from the store's pack of layouts if an
        earlier run made it (the pack mapped once, this layout's pages paged in now and reported like get's reads;
        copy-on-write, so the array is writable as a made one is), else from a file of its own an older agent kept,
        else make(out) fills a new array from the blob, and a background thread appends it to the pack between runs
        (fsynced before it is listed: a listed layout is whole, and nothing listed is written over) for the next
        agent process on this store. A phone's runtime keeps its prepared graphs the same way (QNN's context
        binaries); preparing them is most of a new process's first run otherwise. empty(shape, dtype) allocates a
        made array; into: fill this array instead (read or made)."""
        if not self.has(sha):
            raise StoreError("missing_blob", f"blob {str(sha)[:12]} is not in the store; upload it first")
        if not tag.isalnum():
            raise StoreError("bad_layout", f"a layout tag is letters and digits, got {tag[:20]!r}")
        key, dtype = f"{sha}.{tag}", np.dtype(dtype)
        path = self.layout_dir / key
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        t0 = now_us()
        raw = self._packed(key, nbytes)
        if raw is not None:
            if into is None:
                out = raw.view(dtype).reshape(shape)
            else:
                out = into
                out.reshape(-1).view(np.uint8)[:] = raw
            self._traced(on_read, f"read {sha[:8]}.{tag}", sha, t0, now_us(), nbytes, layout=tag)
            return out
        # a layout an older agent kept in a file of its own: read, and appended to the pack for the next process
        if into is None:
            raw = _map_whole(path, nbytes, private=True)
            out = np.frombuffer(raw, dtype).reshape(shape) if raw is not None else None
        else:
            out = into if _read_whole(path, into.reshape(-1).view(np.uint8)) else None
        if out is not None:
            self._traced(on_read, f"read {sha[:8]}.{tag}", sha, t0, now_us(), out.nbytes, layout=tag)
            self._layout_q.put((key, out))
            return out
        out = empty(tuple(shape), dtype) if into is None else into
        make(out)
        self._layout_q.put((key, out))
        return out

    def _packed(self, key: str, nbytes: int) -> np.ndarray | None:
        """The pack's bytes of layout `key` (uint8[nbytes], writable copy-on-write, paged in now), or None if the
        pack does not list it at that size. The pack is mapped once, not populated; each layout pages in its own
        range: 210 layouts in one mapping instead of 210 files opened and mapped (~35 ms of them beside a first
        run's other mappings, ~10 ms paging in)."""
        with self._lock:
            ent = self._pack_index.get(key)
            if ent is None or ent[1] != nbytes:
                return None
            off, n = ent
            mm = self._pack_map
            if mm is None or off + n > len(mm):  # grown since mapped: map it again (views of the old map stay valid)
                mm = self._pack_map = _map_whole(self.layout_dir / PACK, private=True, populate=False)
            if mm is None or off + n > len(mm):
                return None
        raw = np.frombuffer(mm, np.uint8, count=n, offset=off)
        if n and not _populate_at(raw.ctypes.data, n):
            raw[::PAGE].max()  # before Linux 5.14: one read per page instead
        return raw

    def _layout_worker(self) -> None:
        """Appends each made layout to the pack at the next page-aligned offset, in pieces written between runs,
        fsyncs it, and only then lists it in pack.jsonl (fsynced): a listed layout is whole, and bytes a crash cut
        short are past the last listed one (cut off when the next store opens). Nothing listed is written over."""
        while True:
            key, arr = self._layout_q.get()
            try:
                if key is not None:
                    raw = memoryview(arr.reshape(-1).view(np.uint8))
                    with self._lock:
                        if self._pack_index.get(key, (0, -1))[1] == len(raw):
                            continue  # listed already (made twice by two lanes, or asked for again)
                    off = self._pack_end
                    fd = os.open(self.layout_dir / PACK, os.O_WRONLY | os.O_CREAT, 0o644)
                    try:
                        for i in range(0, len(raw), LAYOUT_PIECE):
                            self._wait_idle()  # a layout write beside a first run cost it ~25% (64 tokens)
                            os.pwrite(fd, raw[i:i + LAYOUT_PIECE], off + i)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    self._pack_log.write(json.dumps({"key": key, "offset": off, "nbytes": len(raw)}) + "\n")
                    self._pack_log.flush()
                    os.fsync(self._pack_log.fileno())
                    with self._lock:
                        self._pack_index[key] = (off, len(raw))
                    self._pack_end = -(-(off + len(raw)) // PAGE) * PAGE
            except OSError as e:  # a layout is a cache: a full disk costs the next process its preparation, no more
                print(f"edgeprobe-agent: keeping layout {key} failed: {e}", file=sys.stderr, flush=True)
            finally:
                if key is None:
                    arr.set()

    @contextlib.contextmanager
    def running(self):
        """Around a run: layouts are written to flash between runs, not beside one."""
        with self._idle:
            self._runs += 1
        try:
            yield
        finally:
            with self._idle:
                self._runs -= 1
                self._idle.notify_all()

    def _wait_idle(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._runs == 0 or self._closing)

    def _open_pack(self) -> None:
        """Read layouts/pack.jsonl (a later line for a key wins) and cut the pack after its last listed layout:
        bytes past it are an append a crash cut short, never listed, never read. Layouts are appended from there."""
        records, self._pack_log = _open_jsonl(self.layout_dir / f"{PACK}.jsonl")
        self._pack_index: dict = {}   # "<sha>.<tag>" -> (offset, nbytes), under self._lock
        end = 0
        for rec in records:
            try:
                key, off, n = rec["key"], rec["offset"], rec["nbytes"]
                if isinstance(key, str) and all(isinstance(v, int) and v >= 0 for v in (off, n)) and off % PAGE == 0:
                    self._pack_index[key] = (off, n)
                    end = max(end, off + n)
            except (KeyError, TypeError):
                continue
        path = self.layout_dir / PACK
        if path.exists() and path.stat().st_size > end:
            os.truncate(path, end)
        self._pack_end = -(-end // PAGE) * PAGE  # where the next layout goes (the layout writer's alone)
        self._pack_map = None   # the pack mapped copy-on-write, remapped when it has grown (under self._lock)
