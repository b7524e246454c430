"""The bundled corpus: enough tokens, a disjoint held-out split, rebuilt deterministically."""
import hashlib
import importlib.util
import json
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
    assert m1 == m2
    # on any interpreter: each split is its documents joined by blank lines, each document the text its sha256 names,
    # split by the held-out rule; the committed corpus and this rebuild alike
    for folder, manifest in ((corpus_dir(), json.loads((corpus_dir() / "SOURCES.json").read_text())),
                             (tmp_path / "a", m1)):
        for split in ("train", "heldout"):
            text = (folder / f"{split}.txt").read_text(encoding="utf-8")
            docs = [d for d in manifest["documents"] if d["split"] == split]
            assert manifest["files"][split] == {"chars": len(text), "documents": len(docs),
                                                "sha256": hashlib.sha256(text.encode()).hexdigest()}
            at = 0
            for d in docs:
                piece = text[at:at + d["chars"]]
                assert hashlib.sha256(piece.encode()).hexdigest() == d["sha256"], d["id"]
                assert (split == "heldout") == b.is_heldout(d["id"]), d["id"]
                at += d["chars"] + 2
            assert at == len(text) + 2
    committed = json.loads((corpus_dir() / "SOURCES.json").read_text())
    # a document this interpreter ships unchanged is the committed one, in the same split (all of them on the
    # interpreter that built it, byte for byte)
    ours = {d["id"]: d for d in m1["documents"]}
    same = [d for d in committed["documents"] if ours.get(d["id"], {}).get("sha256") == d["sha256"]]
    assert all(ours[d["id"]]["split"] == d["split"] for d in same)
    if committed["built_with"] == m1["built_with"]:
        assert len(same) == len(committed["documents"]) == len(ours) and m1["files"] == committed["files"]
    assert m1["files"]["train"]["chars"] > 500_000


def test_missing_corpus_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPROBE_CORPUS", str(tmp_path))
    with pytest.raises(CorpusNotFoundError, match="build_corpus.py"):
        corpus_path("heldout")
    with pytest.raises(ValueError, match="unknown corpus split"):
        corpus_path("validation")
