"""The bundled corpus (datasets/corpus): a profiling split and a held-out evaluation split."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import CorpusNotFoundError

SPLITS = ("train", "heldout")


def corpus_dir() -> Path:
    """$EDGEPROBE_CORPUS, else datasets/corpus beside the package in a source checkout."""
    env = os.environ.get("EDGEPROBE_CORPUS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "datasets" / "corpus"


def corpus_path(split: str = "train") -> Path:
    if split not in SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; choose one of {SPLITS}")
    path = corpus_dir() / f"{split}.txt"
    if not path.exists():
        raise CorpusNotFoundError(f"corpus split {split!r} not found at {path}; rebuild it with "
                                  "`python datasets/build_corpus.py` or set EDGEPROBE_CORPUS to its folder")
    return path


def read_corpus(split: str = "train") -> str:
    return corpus_path(split).read_text(encoding="utf-8")
