"""The agent's blob store on "flash" (a directory): content-addressed, resumable, verified, budgeted.

Layout under the store root:
    blobs/<sha256>            the raw array bytes, named by their sha256
    blobs/index.jsonl         one {"sha", "dtype", "shape"} line per committed blob (appended, fsynced per commit group)
    blobs/<sha256>.json       {"dtype", "shape"} of a blob stored by an older agent (still read)
    partial/<sha256>.part     an upload in progress, preallocated to its full size
    partial/<sha256>.json     {"dtype", "shape", "nbytes", "n_chunks", "chunk_bytes", "have": [chunk indices]}
    layouts/pack              blobs in the layouts kernels read (e.g. "rows": an int8 weight transposed), made by the
                              agent from the verified blobs the first time a run needs them, appended one after
                              another at page-aligned offsets (see `layout`)
    layouts/pack.jsonl        one {"key": "<sha256>.<tag>", "offset", "nbytes"} line per layout in the pack, appended
                              once its bytes are fsynced
    layouts/<sha256>.<tag>    a layout an older agent kept in a file of its own (still read)
Chunks are written into the .part file while a second thread extends the blob's sha256 (a resumed, out-of-order
upload is re-hashed from the file); a blob gets its real name only once its sha256 matches and its bytes and its
index line are fsynced, and its upload is acknowledged complete only once the name is fsynced too. Finished
blobs are committed in groups (their fsyncs in flight together, one index fsync, one folder fsync), so a crash
never leaves a half or unverified blob under its real name, and many small blobs pay neither a disk flush nor a
sidecar file each (creating a file costs ~1 ms on a busy ext4). Reads keep arrays resident in memory up to `memory_budget` bytes, evicting the least recently used; every read from flash is
reported with its bytes and time to the `on_read` the read was called with (the agent passes each run's
own), else to the store's `on_read` (EdgeMoE experts and cold shadow rows use this).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import mmap
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .protocol import AgentError, crc32

_HEX = set("0123456789abcdef")
LAYOUT_PIECE = 4 << 20  # a layout is written in pieces of this many bytes, each between runs
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14: page a mapping in without writing to it


INDEX = "index.jsonl"
PACK = "pack"       # the store's layouts, one file mapped once (see FlashStore.layout)
PAGE = mmap.PAGESIZE


class StoreError(AgentError):
    """A blob the store cannot take or give."""


def check_sha(sha) -> str:
    if not isinstance(sha, str) or len(sha) != 64 or not set(sha) <= _HEX:
        raise StoreError("bad_sha", f"blob id {str(sha)[:70]!r} is not a lowercase hex sha256")
    return sha


def _atomic_write(path: Path, data: bytes, sync: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def now_us() -> float:
    """The agent clock: monotonic microseconds (trace events and hello use it)."""
    return time.perf_counter_ns() / 1000.0


class FlashStore:
    def __init__(self, root, memory_budget: int | None = None, on_read=None, lock_wait_s: float = 10.0):
        self.root = Path(root)
        self.blob_dir, self.part_dir = self.root / "blobs", self.root / "partial"
        self._blob_dir_s = str(self.blob_dir)
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.part_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock_store(self.root, lock_wait_s)  # one agent per store: uploads must not interleave
        self.memory_budget = memory_budget
        self.on_read = on_read
        self._resident: OrderedDict[str, np.ndarray] = OrderedDict()
        self._resident_bytes = 0
        self._lock = threading.RLock()
        # the whole-blob sha256 runs on its own thread (hashlib releases the GIL), overlapping the receipt
        # and writing of the next chunks; in-order chunks extend a running hash, so no second read
        self._hashers: dict = {}      # sha -> running sha256 (owned by the hasher)
        # under self._lock: uploads in progress; each chunk carries its own meta (the writer extends its list)
        self._metas: dict = {}        # sha -> partial sidecar content
        self._received: dict = {}     # sha -> chunk indices accepted (queued or written)
        self._finishing: dict = {}    # sha -> on_done callbacks waiting for the blob's commit
        self._write_errors: dict = {}  # sha -> the write failure its commit reports (under _done_lock)
        self._done_lock = threading.Lock()
        self._write_q: queue.Queue = queue.Queue()
        self._hash_q: queue.Queue = queue.Queue()
        self._commit_q: queue.Queue = queue.Queue()
        self._sync_pool = ThreadPoolExecutor(8, thread_name_prefix="blob-fsync")  # a group's fsyncs in flight at once
        self._sidecars: dict = {}   # sha -> {"dtype", "shape"} of finished blobs (the index; written under _lock)
        self._index = self._open_index()
        for fn, name in ((self._write_worker, "blob-writer"), (self._hash_worker, "blob-sha256"),
                         (self._commit_worker, "blob-commit")):
            threading.Thread(target=fn, daemon=True, name=name).start()
        self.reads = self.read_bytes = 0
        self._mapped: dict = {}     # sha -> read-only memory map of a finished blob (map)
        self.layout_dir = self.root / "layouts"
        self.layout_dir.mkdir(exist_ok=True)
        for tmp in self.layout_dir.glob("*.tmp"):  # a layout being written when an agent stopped: made again on use
            tmp.unlink(missing_ok=True)
        self._open_pack()
        self._layout_q: queue.Queue = queue.Queue()
        self._idle = threading.Condition()  # _runs: runs in flight (running()); _closing: write now, whatever runs
        self._runs, self._closing = 0, False
        threading.Thread(target=self._layout_worker, daemon=True, name="layout-writer").start()

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

    def partial_chunks(self, sha: str) -> list[int]:
        """Chunks of an unfinished upload already written to flash (what a resumed upload may skip)."""
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
    # A chunk goes to two threads at once: the writer (pwrite into partial/<sha>.part, then the chunk list) and
    # the hasher (a running sha256 of in-order chunks). Its reply waits for both, so what a reply reports is on
    # flash, and the client's window bounds the memory held here. The last chunk then goes to the committer,
    # which verifies the whole-blob sha256 and commits blobs in groups: one fsync per file, all of a group's
    # fsyncs in flight at once (the filesystem's journal commits them together), the group's index lines with one
    # fsync, the renames, then one fsync of the blob folder; only then do the group's uploads get "complete".
    def _write_worker(self) -> None:
        while True:
            c = self._write_q.get()
            with self._done_lock:
                if c.fresh:
                    self._write_errors.pop(c.sha, None)  # a failure of an abandoned attempt is not this one's
                failed = c.sha in self._write_errors
            if c.data is not None and not failed:
                try:
                    part = self.part_dir / f"{c.sha}.part"
                    fd = os.open(part, os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if c.fresh else 0), 0o644)
                    try:
                        if c.fresh:
                            os.ftruncate(fd, c.spec["nbytes"])  # preallocated: chunks land at their offsets
                        os.pwrite(fd, c.data, c.offset)
                    finally:
                        os.close(fd)
                    if c.index not in c.meta["have"]:  # a chunk sent twice (its reply was lost) is listed once
                        c.meta["have"].append(c.index)
                    if not c.last:
                        # the chunk list is a hint (no fsync): after a crash the whole-blob hash catches any
                        # chunk it lists but the disk lost, and the upload starts over
                        _atomic_write(self.part_dir / f"{c.sha}.json", json.dumps(c.meta).encode(), sync=False)
                except Exception as e:  # the upload fails at its last chunk; this thread must live on
                    with self._done_lock:
                        self._write_errors[c.sha] = f"{type(e).__name__}: {e}"
            self._chunk_done(c)

    def _hash_worker(self) -> None:
        while True:
            c = self._hash_q.get()
            if c.data is not None:
                if c.fresh:
                    self._hashers.pop(c.sha, None)
                st = self._hashers.setdefault(c.sha, {"next": 0, "h": hashlib.sha256(), "ok": True})
                if st["ok"] and c.index == st["next"]:
                    st["h"].update(c.data)
                    st["next"] += 1
                else:
                    st["ok"] = False  # out of order (a resumed upload): hash the file at the end
                if c.last:
                    st = self._hashers.pop(c.sha)
                    c.digest = st["h"].hexdigest() if st["ok"] and st["next"] == c.spec["n_chunks"] else None
            self._chunk_done(c)

    def _chunk_done(self, c: "_Chunk") -> None:
        """Called by the writer and by the hasher; the second to finish hands the chunk on."""
        with self._done_lock:
            c.pending -= 1
            if c.pending:
                return
        c.data = None  # the frame can go
        if c.last or c.spec is None:  # a blob to finish, or a drain marker
            self._commit_q.put(c)
        else:
            _call(c.on_done, False)

    def _commit_worker(self) -> None:
        while True:
            group = [self._commit_q.get()]
            while True:  # whatever finished meanwhile joins this group: the slower the disk, the larger the group
                try:
                    group.append(self._commit_q.get_nowait())
                except queue.Empty:
                    break
            blobs = [c for c in group if c.spec is not None]
            results = self._commit(blobs) if blobs else {}
            for c in blobs:
                with self._lock:  # the upload is over: a later put of this sha starts from the store's state
                    waiters = self._finishing.pop(c.sha, [])
                    self._metas.pop(c.sha, None)
                    self._received.pop(c.sha, None)
                for w in waiters:
                    _call(w, results[c.sha])
            for c in group:
                if c.spec is None:
                    _call(c.on_done)  # a drain marker: everything queued before it is committed

    def _commit(self, blobs: list) -> dict:
        """Verify each blob's sha256, make the good ones durable and rename them into place (see above).
        Returns sha -> True or a StoreError."""
        results, good = {}, []
        for c in blobs:
            part = self.part_dir / f"{c.sha}.part"
            try:
                with self._done_lock:
                    err = self._write_errors.pop(c.sha, None)
                if err:
                    raise StoreError("write_failed", f"writing blob {c.sha[:12]} to flash failed ({err}); free space "
                                                     "and upload again")
                digest = c.digest or _file_sha256(part)
                if digest != c.sha:
                    part.unlink(missing_ok=True)
                    (self.part_dir / f"{c.sha}.json").unlink(missing_ok=True)
                    raise StoreError("blob_checksum", f"blob {c.sha[:12]} reassembled to sha256 {digest[:12]}; "
                                                      "upload it again")
                good.append(c)
            except Exception as e:
                results[c.sha] = _store_error(c.sha, e)

        futures = [(c, self._sync_pool.submit(_fsync_path, self.part_dir / f"{c.sha}.part")) for c in good]
        try:  # meanwhile: the group's dtype/shape lines in the index, one fsync for all of them
            self._index.write("".join(json.dumps({"sha": c.sha, "dtype": c.spec["dtype"], "shape": c.spec["shape"]})
                                      + "\n" for c in good))
            self._index.flush()
            os.fsync(self._index.fileno())
            index_error = None
        except Exception as e:
            index_error = e
        renamed = []
        for c, f in futures:
            try:
                f.result()
                if index_error is not None:
                    raise index_error
                with self._lock:
                    self._sidecars[c.sha] = {"dtype": c.spec["dtype"], "shape": c.spec["shape"]}
                os.replace(self.part_dir / f"{c.sha}.part", self.blob_dir / c.sha)  # visible: whole and verified
                (self.part_dir / f"{c.sha}.json").unlink(missing_ok=True)
                renamed.append(c)
            except Exception as e:
                results[c.sha] = _store_error(c.sha, e)
        if renamed:
            try:
                _fsync_path(self.blob_dir)  # the group's new names survive a power cut before any reply says so
                results.update({c.sha: True for c in renamed})
            except Exception as e:
                results.update({c.sha: _store_error(c.sha, e) for c in renamed})
        return results

    def _drain(self) -> None:
        """Wait until every chunk queued so far is written, hashed and (if last) committed."""
        ev = threading.Event()
        c = _Chunk("", -1, None, 0, None, None, ev.set)
        self._write_q.put(c)
        self._hash_q.put(c)
        ev.wait()

    def close(self) -> None:
        """Finish every queued chunk write (and its sidecar) before the process exits: the worker threads are
        daemons, so an agent told to stop right after a put_blob would otherwise lose the last chunks."""
        self._drain()  # the queues are FIFO: a marker behind every chunk of every upload
        with self._idle:
            self._closing = True
            self._idle.notify_all()
        self.flush_layouts()

    def flush_layouts(self, timeout: float | None = None) -> bool:
        """Wait until every layout queued so far is in flash (True), or timeout seconds (False)."""
        ev = threading.Event()
        self._layout_q.put((None, ev))
        return ev.wait(timeout)

    def put_chunk(self, sha: str, dtype: str, shape: list, nbytes: int, index: int, n_chunks: int,
                  chunk_bytes: int, chunk_crc32: int, data, on_done=None):
        """Store chunk `index` of blob `sha` (checked against its CRC-32). data: uint8 buffer, kept (not copied)
        until written and hashed.

        The result — False (the chunk is written and listed; more chunks to come), True (the blob is complete:
        its sha256 verified, fsynced and renamed into place) or a StoreError — goes to on_done(result), from a
        worker thread, so the caller keeps receiving meanwhile. Without on_done the call blocks and returns the
        result (raising the error)."""
        if on_done is None:
            box, ev = [], threading.Event()
            self.put_chunk(sha, dtype, shape, nbytes, index, n_chunks, chunk_bytes, chunk_crc32, data,
                           lambda r: (box.append(r), ev.set()))
            ev.wait()
            if isinstance(box[0], Exception):
                raise box[0]
            return box[0]
        check_sha(sha)
        data = memoryview(data).cast("B")
        if crc32(data) != chunk_crc32:
            raise StoreError("chunk_checksum", f"chunk {index} of {sha[:12]} does not match its CRC-32; send it again")
        if np.dtype(dtype).itemsize * math.prod(shape) != nbytes:  # Python ints: no shape overflows into a match
            raise StoreError("bad_blob", f"blob {sha[:12]}: dtype {dtype} and shape {shape} do not make {nbytes} bytes")
        if not (isinstance(n_chunks, int) and n_chunks == max(1, -(-nbytes // chunk_bytes)) and 0 <= index < n_chunks):
            raise StoreError("bad_chunk", f"chunk {index} of {n_chunks} does not fit a {nbytes}-byte blob in "
                                          f"{chunk_bytes}-byte chunks")
        start = index * chunk_bytes
        if len(data) != min(chunk_bytes, nbytes - start) and nbytes:
            raise StoreError("bad_chunk", f"chunk {index} of {sha[:12]} has {len(data)} bytes, expected "
                                          f"{min(chunk_bytes, nbytes - start)}")
        spec = {"dtype": dtype, "shape": list(shape), "nbytes": nbytes, "n_chunks": n_chunks, "chunk_bytes": chunk_bytes}
        with self._lock:
            if sha in self._finishing:
                self._finishing[sha].append(on_done)  # being finished: answered when it is committed
                return
            if sha not in self._metas and self.has(sha):
                on_done(True)  # already stored
                return
            meta, fresh = self._metas.get(sha), False
            if meta is None or any(meta.get(k) != v for k, v in spec.items()):
                meta = self._part_meta(sha)
                if meta is None or any(meta.get(k) != v for k, v in spec.items()):
                    meta, fresh = {**spec, "have": []}, True  # the writer (re)creates the .part, the hasher resets
                self._metas[sha] = meta
                self._received[sha] = set(meta["have"])
            self._received[sha].add(index)
            last = len(self._received[sha]) >= n_chunks
            if last:
                self._finishing[sha] = [on_done]
            c = _Chunk(sha, index, data, start, spec, meta, on_done, fresh=fresh, last=last)
            self._write_q.put(c)
            self._hash_q.put(c)

    # ---- reads --------------------------------------------------------------------------------
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

    def layout(self, sha: str, tag: str, shape: tuple, dtype, make, empty=np.empty, on_read=None,
               into: np.ndarray | None = None) -> np.ndarray:
        """Blob sha in the layout `tag` that a kernel reads (shape, dtype): from the store's pack of layouts if an
        earlier run made it (the pack mapped once, this layout's pages paged in now and reported like get's reads;
        copy-on-write, so the array is writable as a made one is), else from a file of its own an older agent kept,
        else make(out) fills a new array from the blob, and a background thread appends it to the pack between runs
        (fsynced before it is listed: a listed layout is whole, and nothing listed is written over) for the next
        agent process on this store. A phone's runtime keeps its prepared graphs the same way (QNN's context binaries); preparing
        them is most of a new process's first run otherwise. empty(shape, dtype) allocates a made array; into: fill
        this array instead (read or made)."""
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

    def _meta_of(self, sha: str) -> dict | None:
        """{"dtype", "shape"} of a finished blob: from the index, or the sidecar an older agent wrote; None if neither."""
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
        """Read blobs/index.jsonl and open it for appending."""
        records, f = _open_jsonl(self.blob_dir / INDEX)
        for rec in records:
            try:
                self._sidecars[check_sha(rec["sha"])] = {"dtype": rec["dtype"], "shape": rec["shape"]}
            except (KeyError, TypeError, StoreError):
                continue
        return f

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

    def stats(self) -> dict:
        blobs = [p for p in self.blob_dir.iterdir() if len(p.name) == 64]
        return {"blobs": len(blobs), "bytes": sum(p.stat().st_size for p in blobs),
                "partial": len(list(self.part_dir.glob("*.part"))), "resident_bytes": self._resident_bytes,
                "memory_budget": self.memory_budget, "reads": self.reads, "read_bytes": self.read_bytes}


def _lock_store(root: Path, wait_s: float):
    """An exclusive lock on root/.lock for this process's life (released by the OS when it exits); waits up to
    wait_s for an agent that is shutting down, then refuses naming the holder."""
    import fcntl

    f = open(root / ".lock", "a+")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.seek(0)
                holder = f.read().strip() or "?"
                f.close()
                raise StoreError("store_busy", f"the store {root} is in use by another agent (pid {holder}); give "
                                               "this agent its own --store, or stop the other one") from None
            time.sleep(0.2)
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def _map_whole(path: Path, nbytes: int | None = None, private: bool = False, populate: bool = True) -> mmap.mmap | None:
    """The file mapped whole and paged in now (no zero-filled pages and no copy: ~4x faster than reading 100 MB of
    layouts into new memory here), or None if it is missing, empty or not nbytes long. Read-only and shared, or
    private: writable copy-on-write, so a kernel that writes never reaches the file, and numba sees the same
    writable arrays as the copies it was warmed on."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0 or (nbytes is not None and size != nbytes):
                return None
            if not private:
                return mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                 prot=mmap.PROT_READ)
            # MAP_POPULATE would fault a writable private mapping for writing: a copy of every page
            mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except FileNotFoundError:
        return None
    if populate and not _populate_at(ctypes.addressof(ctypes.c_char.from_buffer(mm)), len(mm)):
        np.frombuffer(mm, np.uint8)[::PAGE].max()  # before Linux 5.14: one read per page instead
    return mm


def _populate_at(addr: int, length: int) -> bool:
    """Page in `length` bytes of a writable private mapping from page-aligned `addr` without writing to them
    (MADV_POPULATE_READ), through ctypes, which lets go of the GIL for the call (mmap.madvise holds it: the other
    lanes' Python waited out each layout's paging)."""
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
            _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return _LIBC.madvise(addr, length, MADV_POPULATE_READ) == 0
    except (OSError, AttributeError, TypeError):
        return False


_LIBC = None


def _open_jsonl(path: Path) -> tuple[list, object]:
    """The records of an append-only JSON-lines file (a torn last line, cut mid-append, was never acknowledged:
    skipped) and the file opened for appending, so that the next record starts on a line of its own."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                records.append(rec)
    f = open(path, "a")
    if f.tell() and not path.read_bytes().endswith(b"\n"):
        f.write("\n")
    return records, f


def _read_whole(path: Path, buf: np.ndarray) -> bool:
    """Fill uint8 buf with the file's bytes if it exists and has exactly buf's size; False otherwise."""
    try:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != buf.nbytes:
                return False
            view, got = memoryview(buf), 0
            while got < buf.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    return False
                got += n
            return True
    except FileNotFoundError:
        return False


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


class _Chunk:
    """One received chunk on its way through the writer and the hasher (both hold it; `pending` counts them)."""
    __slots__ = ("sha", "index", "data", "offset", "spec", "meta", "on_done", "fresh", "last", "pending", "digest")

    def __init__(self, sha, index, data, offset, spec, meta, on_done, fresh=False, last=False):
        self.sha, self.index, self.data, self.offset, self.spec, self.meta = sha, index, data, offset, spec, meta
        self.on_done, self.fresh, self.last, self.pending, self.digest = on_done, fresh, last, 2, None


def _call(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # a failing callback must not stop every later upload
        print(f"edgeprobe-agent: upload callback failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _store_error(sha: str, e: Exception) -> StoreError:
    if isinstance(e, StoreError):
        return e
    if isinstance(e, OSError):
        return StoreError("write_failed", f"finishing blob {sha[:12]} failed ({e}); upload it again")
    return StoreError("internal", f"finishing blob {sha[:12]} failed ({type(e).__name__}: {e})")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
