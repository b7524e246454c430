"""The bundled corpus: enough tokens, a disjoint held-out split, rebuilt deterministically."""
import importlib.util
import json
import platform
from pathlib import Path

import pytest

from edgeprobe.corpus import corpus_dir, corpus_path, read_corpus
from edgeprobe.errors import CorpusNotFoundError

ROOT = Path(__file__).resolve().parents[1]


def _builder():
    spec = importlib.util.spec_from_file_location("build_corpus", ROOT / "datasets" / "build_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sizes_and_split(smollm):
    train = smollm.tokenizer.encode(read_corpus("train"))
    heldout = smollm.tokenizer.encode(read_corpus("heldout"))
    assert len(train) >= 100_000 and len(heldout) >= 8 * 512
    manifest = json.loads((corpus_dir() / "SOURCES.json").read_text())
    by_split = {}
    for d in manifest["documents"]:
        by_split.setdefault(d["split"], set()).add(d["id"])
    assert by_split["train"].isdisjoint(by_split["heldout"]) and len(by_split["heldout"]) >= 5
    assert "PSF" in manifest["license"]


def test_rebuild_is_deterministic(tmp_path):
    b = _builder()
    m1, m2 = b.build(tmp_path / "a"), b.build(tmp_path / "b")
    for split in ("train", "heldout"):
        assert (tmp_path / "a" / f"{split}.txt").read_bytes() == (tmp_path / "b" / f"{split}.txt").read_bytes()
    committed = json.loads((corpus_dir() / "SOURCES.json").read_text())
    if committed["built_with"] == f"CPython {platform.python_version()}":
        # same interpreter as the committed build: byte-identical files
        assert m1["files"] == committed["files"]
    assert m1["files"]["train"]["chars"] > 500_000


def test_missing_corpus_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPROBE_CORPUS", str(tmp_path))
    with pytest.raises(CorpusNotFoundError, match="build_corpus.py"):
        corpus_path("heldout")
    with pytest.raises(ValueError, match="unknown corpus split"):
        corpus_path("validation")
