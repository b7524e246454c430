"""The store's uploads: chunks written into partial/<sha>.part while a second thread extends the blob's sha256,
and blobs committed in groups once verified (see Uploads).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..protocol import crc32
from .files import StoreError, _atomic_write, _file_sha256, _fsync_path, check_sha


class Uploads:
    """FlashStore's upload side (a mixin: FlashStore gives it has(), part_dir, blob_dir, _lock, _sidecars, _index).

    A chunk goes to two threads at once: the writer (pwrite into partial/<sha>.part, then the chunk list) and the
    hasher (a running sha256 of in-order chunks). Its reply waits for both, so what a reply reports is on flash, and
    the client's window bounds the memory held here. The last chunk then goes to the committer, which verifies the
    whole-blob sha256 and commits blobs in groups: one fsync per file, all of a group's fsyncs in flight at once, the
    group's index lines with one fsync, the renames, then one fsync of the blob folder; only then do the group's
    uploads get "complete"."""

    def _init_uploads(self) -> None:
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
        for fn, name in ((self._write_worker, "blob-writer"), (self._hash_worker, "blob-sha256"),
                         (self._commit_worker, "blob-commit")):
            threading.Thread(target=fn, daemon=True, name=name).start()

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
        spec = {"dtype": dtype, "shape": list(shape), "nbytes": nbytes, "n_chunks": n_chunks,
                "chunk_bytes": chunk_bytes}
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
