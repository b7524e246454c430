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


def read_text_file(path) -> str:
    """A UTF-8 text file, or TextError saying why it cannot serve as a corpus."""
    from .errors import TextError

    p = Path(path)
    if not p.exists():
        raise TextError(f"text file {path} does not exist; pass an existing UTF-8 text file")
    if p.is_dir():
        raise TextError(f"{path} is a folder; pass a UTF-8 text file")
    data = p.read_bytes()
    if b"\x00" in data[:1 << 20]:
        raise TextError(f"{path} looks binary (it contains NUL bytes); pass a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TextError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8 "
                        "(e.g. iconv -t utf-8) or pass another file") from e
