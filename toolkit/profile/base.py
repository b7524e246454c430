"""What every profile shares: per-tensor arrays that merge by sum or max, metadata, save/load."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..errors import StatsMismatchError
from ..models import Model
from .store import ids_sha256, load_npz, npz_bytes, save_npz


@dataclass
class Profile:
    """Base of OutlierStats and SparsityStats.

    arrays[tensor][field]: per-tensor state; FIELDS[field] says how two shards combine ("sum" or
    "max"), so `a.merge(b)` equals one pass over both shards exactly. params: thresholds and
    settings that must match for a merge (they define what was counted).
    """

    model_name: str
    model_sha256: str
    params: dict
    arrays: dict = field(default_factory=dict)
    tokens: int = 0
    windows: int = 0
    corpus_sha256: list = field(default_factory=list)

    KIND: ClassVar[str] = "profile"
    FIELDS: ClassVar[dict] = {}

    # ---- streaming ------------------------------------------------------------------------------
    def hooks(self, model: Model) -> dict:
        """name -> hook(name, x) for the forward pass; the hooks only observe (return None)."""
        raise NotImplementedError

    def begin_window(self, ids: np.ndarray) -> None:
        """Called by the runner before each forward call (one window = one sequence)."""
        self.corpus_sha256.append(ids_sha256(ids))

    def end_window(self, n_tokens: int) -> None:
        self.tokens += n_tokens
        self.windows += 1

    def at_window(self, w: int) -> None:
        """A layer-major pass (runner.run_layers) calls begin_window for every window first, then this before window
        w's ops of each layer (w counts this pass's windows from 0), then end_window for each window in order. A
        profile that keeps state between begin_window and end_window switches to window w's here; the default
        keeps none. Window-major passes never call it."""

    def _check_model(self, model: Model) -> None:
        if model.sha256 != self.model_sha256:
            raise StatsMismatchError(f"this {self.KIND} profile belongs to model {self.model_name} "
                                     f"({self.model_sha256[:12]}), not {model.name} ({model.sha256[:12]})")

    def empty(self) -> "Profile":
        """A profile of the same model and settings that has seen nothing (what a shard starts from)."""
        return type(self)(model_name=self.model_name, model_sha256=self.model_sha256, params=copy.deepcopy(self.params))

    # ---- values ---------------------------------------------------------------------------------
    def merge(self, other: "Profile") -> "Profile":
        """A new profile equal to one pass over both shards."""
        if type(other) is not type(self):
            raise StatsMismatchError(f"cannot merge a {type(other).__name__} into a {type(self).__name__}")
        if other.model_sha256 != self.model_sha256:
            raise StatsMismatchError(f"cannot merge profiles of different models: {self.model_name} "
                                     f"({self.model_sha256[:12]}) and {other.model_name} ({other.model_sha256[:12]})")
        if not _params_equal(self.params, other.params):
            diff = sorted(k for k in set(self.params) | set(other.params)
                          if not _params_equal(self.params.get(k), other.params.get(k)))
            raise StatsMismatchError(f"cannot merge {self.KIND} profiles taken with different thresholds or "
                                     f"settings ({', '.join(diff)}); profile both shards with the same ones")
        out = copy.deepcopy(self)
        for t, fields in other.arrays.items():
            mine = out.arrays.setdefault(t, {})
            for f, a in fields.items():
                if f not in mine:
                    mine[f] = a.copy()
                elif self.FIELDS.get(f, "sum") == "max":
                    np.maximum(mine[f], a, out=mine[f])
                else:
                    mine[f] = mine[f] + a
        out.tokens += other.tokens
        out.windows += other.windows
        out.corpus_sha256 = self.corpus_sha256 + other.corpus_sha256
        return out

    def __add__(self, other):
        return self.merge(other)

    def _meta(self) -> dict:
        return {"kind": self.KIND, "model": {"name": self.model_name, "sha256": self.model_sha256},
                "corpus_sha256": self.corpus_sha256, "tokens": self.tokens, "windows": self.windows,
                "params": _jsonable(self.params)}

    def save(self, path):
        return save_npz(path, self._meta(), self.arrays)

    def to_bytes(self) -> bytes:
        """The .npz file `save` writes, in memory: how a shard travels between a Ray worker and the driver."""
        return npz_bytes(self._meta(), self.arrays)

    @classmethod
    def load(cls, path) -> "Profile":
        """path: a saved .npz, or the bytes of one (to_bytes)."""
        meta, arrays = load_npz(path, cls.KIND)
        return cls(model_name=meta["model"]["name"], model_sha256=meta["model"]["sha256"],
                   params=meta["params"], arrays=arrays, tokens=meta["tokens"], windows=meta["windows"],
                   corpus_sha256=meta["corpus_sha256"])

    __hash__ = None

    def __eq__(self, other) -> bool:
        return (type(other) is type(self) and self.model_sha256 == other.model_sha256
                and _params_equal(self.params, other.params) and self.tokens == other.tokens
                and self.arrays.keys() == other.arrays.keys()
                and all(self.arrays[t].keys() == other.arrays[t].keys()
                        and all(np.array_equal(self.arrays[t][f], other.arrays[t][f]) for f in self.arrays[t])
                        for t in self.arrays))


def _jsonable(v):
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


def _params_equal(a, b) -> bool:
    return _jsonable(a) == _jsonable(b)
