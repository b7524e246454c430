"""Decode weight copies packed into large chunks, so the kernel streams them through 2 MiB pages.

A decode step reads every weight once (~100 MB for SmolLM2 in int8), which no cache holds: the GEMV runs at memory
speed, and on 4 KiB pages each 4 KiB of weights is a TLB miss and a stop for the hardware prefetcher. numpy asks
the kernel for transparent huge pages on large allocations (madvise), but a layer's copies are each below 2 MiB, so
alone they never get one. Packed into 32 MiB chunks they do (bench/decode.py compares).
"""
from __future__ import annotations

import threading

import numpy as np

CHUNK = 32 << 20
ALIGN = 64  # a cache line: each copy starts on one


class Arena:
    """A bump allocator: copies live inside chunks (numpy arrays) that are freed when no copy of theirs is left."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._buf: np.ndarray | None = None
        self._used = 0
        self._lock = threading.Lock()  # lanes build runners concurrently

    def copy(self, a: np.ndarray) -> np.ndarray:
        """A C-contiguous, writable copy of a (any shape, any dtype) inside a chunk."""
        a = np.asarray(a)
        out = self.empty(a.shape, a.dtype)
        out[...] = a
        return out

    def empty(self, shape: tuple, dtype) -> np.ndarray:
        """A new C-contiguous array inside a chunk, for the caller to fill."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        if n == 0 or n > self.chunk // 4:  # a large copy is a large allocation already: huge pages by itself
            return np.empty(shape, dtype)
        with self._lock:
            start = self._aligned(self._used)
            if self._buf is None or start + n > self._buf.size:
                self._buf = np.empty(self.chunk + ALIGN, np.uint8)
                start = self._aligned(0)
            out = self._buf[start:start + n].view(dtype).reshape(shape)
            self._used = start + n
        return out


    def _aligned(self, offset: int) -> int:
        """The first offset >= offset whose address in the current chunk is a multiple of ALIGN."""
        if self._buf is None:
            return 0
        return offset + (-(self._buf.ctypes.data + offset)) % ALIGN


ARENA = Arena()
