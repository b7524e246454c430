"""Lazily dequantized float32 weights: an optional on-disk float32 cache keyed by the checkpoint's sha256 (small
models), else dequantized from the checkpoint on access and held in memory up to a byte budget (issue 43, item 1)."""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np


def default_cache_dir() -> Path:
    """$EDGEPROBE_CACHE, else $XDG_CACHE_HOME/edgeprobe, else ~/.cache/edgeprobe: the one root of edgeprobe's state
    (edgeprobe_kernels.paths.cache_root)."""
    from edgeprobe_kernels.paths import cache_root

    return cache_root()


def _env_mb(var: str, default: int) -> int:
    """$var in MB as bytes, else `default` bytes."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        mb = int(raw)
    except ValueError:
        mb = -1
    if mb < 0:
        from ..errors import EdgeprobeError

        raise EdgeprobeError(f"${var}={raw!r} is not a size in MB; give a whole number of megabytes (0 or more)")
    return mb << 20


def npy_cache_limit() -> int:
    """Bytes of float32 weights up to which a checkpoint gets the float32 .npy cache: $EDGEPROBE_NPY_CACHE_MAX_MB,
    default 2048 (the built-in models, 0.5 and 1.1 GB, map it instead of dequantizing again each process; a 1-8B
    model would write 5-32 GB, 4x its checkpoint, so it is dequantized from the checkpoint instead)."""
    return _env_mb("EDGEPROBE_NPY_CACHE_MAX_MB", 2048 << 20)


def default_hold_bytes() -> int:
    """Bytes of dequantized tensors a model keeps in memory (not mapped from a cache) before it drops the least
    recently used: $EDGEPROBE_WEIGHTS_HOLD_MB, default a quarter of this machine's RAM."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return _env_mb("EDGEPROBE_WEIGHTS_HOLD_MB", ram // 4)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class LazyWeights(Mapping[str, np.ndarray]):
    """name -> float32 array, dequantized on first access.

    `loaders[name]()` produces the float32 tensor (e.g. through `gguf.quants.dequantize`). With a `cache_dir`, its
    result is written to `cache_dir/name.npy` so the next process maps it instead of dequantizing again. With
    `cache_dir=None`, or when the cache cannot be written (read-only, disk full: a warning says so once), tensors are
    kept in memory only, at most `hold_bytes` of them (default `default_hold_bytes()`): past that the least recently
    used are dropped, and dequantized again on their next access (a warning says so once: a window-major pass over
    such a model dequantizes every layer per window; a layer-major pass reads each layer once).

    Every tensor returned is held (mapped or in memory) until `release` drops it: a layer-major pass releases each
    layer once done with it, so its peak memory is one layer's weights, not the model's (issue 43, item 2).
    Safe to read from several threads: the holding is under a lock, the dequantization outside it.
    """

    def __init__(self, loaders: dict[str, Callable[[], np.ndarray]], cache_dir: Path | None,
                 hold_bytes: int | None = None, parts: dict[str, Callable[[int], np.ndarray]] | None = None):
        self._loaders = loaders
        self._parts = parts or {}  # name -> load(i): slice i of a stacked tensor read alone (an MoE expert)
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._mem: OrderedDict[str, np.ndarray] = OrderedDict()  # least recently used first
        self._held = 0   # bytes of _mem that live in memory (a memory map is the page cache's to drop)
        self.hold_bytes = default_hold_bytes() if hold_bytes is None else int(hold_bytes)
        self._lock = threading.Lock()
        self._warned = False
        self._warned_evict = False

    def __getitem__(self, name: str) -> np.ndarray:
        arr = self._held_now(name)
        if arr is not None:
            return arr
        if name not in self._loaders:
            raise KeyError(f"no tensor named {name!r} in this model")
        arr = self._from_cache(name)
        if arr is None:
            arr = np.ascontiguousarray(self._loaders[name](), dtype=np.float32)
            if self._to_cache(name, arr):
                # the first load maps what it wrote, as every later process does: one kind of array (read-only,
                # in the page cache, not held bytes) whether the cache was cold or warm
                mapped = self._from_cache(name)
                arr = arr if mapped is None else mapped
        return self._hold(name, arr)

    def part(self, name: str, i: int) -> np.ndarray:
        """Slice i of the stacked tensor `name` (an MoE expert: [E, out, in] -> float32[out, in]). Read alone where
        the loader can and the model has no .npy cache (a large model: one expert, not the stack of E), and held
        as "name#i" (released with `name`); else self[name][i]."""
        key = f"{name}#{int(i)}"
        arr = self._held_now(key)
        if arr is not None:
            return arr
        with self._lock:
            whole = self._mem.get(name)
        if whole is not None or self._cache_dir is not None or name not in self._parts:
            return self[name][i]
        return self._hold(key, np.ascontiguousarray(self._parts[name](int(i)), dtype=np.float32))

    def _held_now(self, key: str) -> np.ndarray | None:
        with self._lock:
            arr = self._mem.get(key)
            if arr is not None:
                self._mem.move_to_end(key)
            return arr

    def _hold(self, key: str, arr: np.ndarray) -> np.ndarray:
        with self._lock:
            if key in self._mem:  # another thread loaded it meanwhile: one copy held
                return self._mem[key]
            self._mem[key] = arr
            self._held += _in_memory(arr)
            self._evict(keep=key)
        return arr

    def _evict(self, keep: str) -> None:
        """Drop the least recently used in-memory tensors (never `keep`) until the held bytes fit hold_bytes."""
        if self._held <= self.hold_bytes:
            return
        for other in [n for n, a in self._mem.items() if n != keep and _in_memory(a)]:
            if self._held <= self.hold_bytes:
                break
            self._held -= _in_memory(self._mem.pop(other))
            if not self._warned_evict:
                self._warned_evict = True
                warnings.warn(f"edgeprobe: this model's dequantized weights exceed the {self.hold_bytes >> 20} MB held "
                              "in memory; the least recently used are dropped and dequantized again when next read "
                              "(a window-major pass re-reads every layer per window: profile with --order layer, or "
                              "raise $EDGEPROBE_WEIGHTS_HOLD_MB)", RuntimeWarning, stacklevel=3)

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)

    def __contains__(self, name) -> bool:
        return name in self._loaders

    def _path(self, name: str) -> Path:
        return self._cache_dir / f"{name}.npy"

    def _from_cache(self, name: str) -> np.ndarray | None:
        if self._cache_dir is None:
            return None
        path = self._path(name)
        if not path.exists():
            return None
        try:
            return np.load(path, mmap_mode="r")
        except (ValueError, OSError):
            path.unlink(missing_ok=True)  # a damaged cache entry: dequantize again
            return None

    def _to_cache(self, name: str, arr: np.ndarray) -> bool:
        """Write arr as cache_dir/name.npy; whether it was written (no cache, or one that cannot be written: False)."""
        if self._cache_dir is None:
            return False
        try:
            self._cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._cache_dir, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    np.save(f, arr)
                os.replace(tmp, self._path(name))  # atomic: a reader never sees half a file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return True
        except OSError as e:
            if not self._warned:
                warnings.warn(f"edgeprobe: cannot write the weight cache in {self._cache_dir} ({e}); "
                              "keeping dequantized weights in memory only. Free disk space or set "
                              "EDGEPROBE_CACHE to a writable directory.", RuntimeWarning, stacklevel=3)
                self._warned = True
            self._cache_dir = None
            return False

    def resident(self) -> frozenset[str]:
        """The names of the tensors held now (mapped from the cache or in memory); a part as "name#i"."""
        with self._lock:
            return frozenset(self._mem)

    def release(self, names) -> None:
        """Stop holding these tensors (names not held are ignored): a mapped one is unmapped and an in-memory one
        freed once nothing else refers to it, so its pages leave the RSS. The next access maps the cache again, or
        dequantizes again where there is no cache."""
        with self._lock:
            names = set(names)
            for key in [k for k in self._mem if k in names or k.split("#", 1)[0] in names]:  # a stack's parts too
                self._held -= _in_memory(self._mem.pop(key))

    def held_bytes(self) -> int:
        """Bytes of the tensors held in memory now (memory-mapped ones from the cache not counted)."""
        return self._held

    def materialize(self) -> "LazyWeights":
        """Dequantize (or map) every tensor now, e.g. before timing a forward pass."""
        for name in self._loaders:
            self[name]
        return self


def _in_memory(arr: np.ndarray) -> int:
    """Bytes `arr` holds in anonymous memory: 0 for a memory map of the .npy cache (or a view of one)."""
    base = arr
    while isinstance(base, np.ndarray):
        if isinstance(base, np.memmap):
            return 0
        base = base.base
    return arr.nbytes
