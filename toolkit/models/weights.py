"""Lazily dequantized float32 weights with an on-disk cache keyed by the checkpoint's sha256."""
from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np


def default_cache_dir() -> Path:
    """$EDGEPROBE_CACHE, else $XDG_CACHE_HOME/edgeprobe, else ~/.cache/edgeprobe."""
    if os.environ.get("EDGEPROBE_CACHE"):
        return Path(os.environ["EDGEPROBE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgeprobe"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class LazyWeights(Mapping[str, np.ndarray]):
    """name -> float32 array, dequantized on first access and cached as .npy (memory-mapped).

    `loaders[name]()` produces the float32 tensor (e.g. through `gguf.quants.dequantize`); its result
    is written to `cache_dir/name.npy` so the next process maps it instead of dequantizing again.
    With `cache_dir=None`, or when the cache cannot be written (read-only, disk full), tensors are
    kept in memory only and a warning says so once.

    Every tensor returned is held (mapped or in memory) until `release` drops it: a layer-major pass releases each
    layer once done with it, so its peak memory is one layer's weights, not the model's (issue 43, item 2).
    """

    def __init__(self, loaders: dict[str, Callable[[], np.ndarray]], cache_dir: Path | None):
        self._loaders = loaders
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._mem: dict[str, np.ndarray] = {}
        self._warned = False

    def __getitem__(self, name: str) -> np.ndarray:
        arr = self._mem.get(name)
        if arr is not None:
            return arr
        if name not in self._loaders:
            raise KeyError(f"no tensor named {name!r} in this model")
        arr = self._from_cache(name)
        if arr is None:
            arr = np.ascontiguousarray(self._loaders[name](), dtype=np.float32)
            self._to_cache(name, arr)
        self._mem[name] = arr
        return arr

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

    def _to_cache(self, name: str, arr: np.ndarray) -> None:
        if self._cache_dir is None:
            return
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
        except OSError as e:
            if not self._warned:
                warnings.warn(f"edgeprobe: cannot write the weight cache in {self._cache_dir} ({e}); "
                              "keeping dequantized weights in memory only. Free disk space or set "
                              "EDGEPROBE_CACHE to a writable directory.", RuntimeWarning, stacklevel=3)
                self._warned = True
            self._cache_dir = None

    def resident(self) -> frozenset[str]:
        """The names of the tensors held now (mapped from the cache or in memory)."""
        return frozenset(self._mem)

    def release(self, names) -> None:
        """Stop holding these tensors (names not held are ignored): a mapped one is unmapped and an in-memory one
        freed once nothing else refers to it, so its pages leave the RSS. The next access maps the cache again, or
        dequantizes again where there is no cache."""
        for name in names:
            self._mem.pop(name, None)

    def materialize(self) -> "LazyWeights":
        """Dequantize (or map) every tensor now, e.g. before timing a forward pass."""
        for name in self._loaders:
            self[name]
        return self
