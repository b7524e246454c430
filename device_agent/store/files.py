"""What every part of the blob store uses: its error, blob names, the agent clock, and file operations (atomic
writes, fsyncs, whole-file maps paged in without copying, append-only JSON-lines files, the store's lock).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..protocol import AgentError

_HEX = set("0123456789abcdef")
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14: page a mapping in without writing to it
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
    before = f.read().strip()
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    if before.isdigit() and int(before) != os.getpid():  # a holder killed before it could clear its pid
        print(f"edgeprobe-agent: the store {root} was last locked by pid {before}, which ended without releasing it; "
              "its lock is taken over", file=sys.stderr, flush=True)
    return f


def _unlock_store(f) -> None:
    """Clear this agent's pid from the store's lock file, then release it: a stopped agent leaves no pid behind."""
    try:
        f.seek(0)
        f.truncate()
        f.flush()
    finally:
        f.close()


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



def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
