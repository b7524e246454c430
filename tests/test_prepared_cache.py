"""One prepared-model cache (edgeprobe.prepare): a model prepared by one entry point is read back by the others —
shown by the cache's files and by counting calibrations and quantizations, not by what they print. Its entries are
listed as current or stale and the stale ones pruned (`edgeprobe cache`), checked on the files left on disk."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from edgeprobe import models
from edgeprobe.cli import main
from edgeprobe.prepare import TEMP_GRACE_S, cache_entries, code_version, prepared, prune


@pytest.fixture(scope="module")
def smol():
    return models.load("smollm2-135m")


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """An empty prepared-model cache and a list of the expensive steps as they run."""
    import edgeprobe.quant as quant

    monkeypatch.setenv("EDGEPROBE_PREPARED_CACHE", str(tmp_path))
    ran = []
    for name in ("calibration_profile", "quantize"):
        real = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda *a, _n=name, _r=real, **k: (ran.append(_n), _r(*a, **k))[1])
    return ran


def _files(root):
    return {p.relative_to(root): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_python_api_then_quantize_report_and_out(smol, tmp_path, counted, capsys):
    prepared(smol, "w8a8-shadow", calib_tokens=128)
    assert counted == ["calibration_profile", "quantize"]
    # what prepare wrote records today's code version: listed current, kept by a prune
    assert sorted((e["kind"], e["scheme"], e["state"]) for e in cache_entries()) == [
        ("calibration", None, "current"), ("model", "w8a8-shadow", "current")]
    before = _files(tmp_path)
    assert prune() == [] and _files(tmp_path) == before
    assert main(["quantize", "--report", "--schemes", "w8a8-shadow", "--calib-tokens", "128", "--window", "128",
                 "--max-windows", "1", "--json", "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["scheme"] for r in rows] == ["w8a8-shadow"]
    assert counted == ["calibration_profile", "quantize"] and _files(tmp_path) == before  # read back, nothing new
    assert main(["quantize", "--scheme", "w8a8-shadow", "--out", str(tmp_path.parent / "q"), "--calib-tokens", "128",
                 "--no-progress"]) == 0  # (its calibration window: min(--window, --calib-tokens), 128 as above)
    assert counted == ["calibration_profile", "quantize"] and _files(tmp_path) == before
    # a scheme the report prepares first is then the Python API's, read back
    assert main(["quantize", "--report", "--schemes", "w8a8", "--calib-tokens", "128", "--window", "128",
                 "--max-windows", "1", "--json", "--no-progress"]) == 0
    assert counted == ["calibration_profile", "quantize", "quantize"]
    after = _files(tmp_path)
    new = {p.parts[0] for p in set(after) - set(before)}
    assert len(new) == 1 and new.pop().startswith("smollm2-135m-w8a8-")  # one more entry, beside the first
    prepared(smol, "w8a8", calib_tokens=128)
    assert counted == ["calibration_profile", "quantize", "quantize"] and _files(tmp_path) == after


def test_python_api_then_run_and_schedule(smol, tmp_path, counted, capsys):
    """At the defaults run and schedule use (cli.common.prepared_model: what `run` calls before it opens a
    connection to its agent), a model the Python API prepared is the one they read."""
    from edgeprobe.cli.common import prepared_model

    a = prepared(smol, "w8a8-shadow")
    assert counted == ["calibration_profile", "quantize"]
    before = _files(tmp_path)
    b = prepared_model(smol, "w8a8-shadow", False)
    assert a.manifest["blobs"] == b.manifest["blobs"]
    assert main(["schedule", "--prompt-len", "256", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["scheme"] == "w8a8-shadow"
    assert counted == ["calibration_profile", "quantize"] and _files(tmp_path) == before


OLD = "0123456789abcdef"  # a code version no source hashes to


def _model_entry(root, name, scheme, key, version, blob=b"x" * 1000):
    """A folder laid out as prepared() publishes one: manifest.json (with the code version it recorded, or none for
    an entry from before they did) and blobs/."""
    folder = root / f"{name}-{scheme}-{key}"
    (folder / "blobs").mkdir(parents=True)
    (folder / "blobs" / ("ab" * 32)).write_bytes(blob)
    manifest = {"format": "edgeprobe-quantized", "format_version": 1, "scheme": scheme,
                "model": {"name": name, "sha256": "f" * 64}, "blobs": {}}
    if version is not None:
        manifest["prepared"] = {"code_version": version, "settings": {"scheme": scheme}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _calib_entry(root, name, key, version):
    """A calibration .npz as calibration() writes one: the profile's metadata naming its code version (or not)."""
    from edgeprobe.profile.store import save_npz

    meta = {"kind": "outliers"} if version is None else {"kind": "outliers", "prepared": {"code_version": version}}
    return save_npz(root / f"calib-{name}-{key}.npz", meta, {"blk.0.attn_q": {"absmax": np.arange(64.0)}})


def _du(path):
    return sum(p.stat().st_size for p in [path, *path.rglob("*")] if p.is_file())


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """Every kind of entry prepare.py leaves in a cache: {name: path}, and the state each should be listed in."""
    root = tmp_path / "prepared"
    root.mkdir()
    monkeypatch.setenv("EDGEPROBE_PREPARED_CACHE", str(root))
    today = code_version()
    paths = {
        "current": _model_entry(root, "smollm2-135m", "w8a8-shadow", "1" * 16, today),
        "stale": _model_entry(root, "smollm2-135m", "w8a8-shadow", "2" * 16, OLD),
        "unrecorded": _model_entry(root, "gemma3-270m", "w8a8", "3" * 16, None),
        "incomplete": root / f"tiny-moe-w4a16-{'4' * 16}",
        "calib-current": _calib_entry(root, "smollm2-135m", "5" * 16, today),
        "calib-stale": _calib_entry(root, "smollm2-135m", "6" * 16, OLD),
        "calib-unrecorded": _calib_entry(root, "gemma3-270m", "7" * 16, None),
        "writing": root / f".smollm2-135m-w8a8-{'8' * 16}.{time.time_ns()}.tmp",
        "abandoned": root / f".smollm2-135m-w8a8-{'9' * 16}.{time.time_ns() - 2 * 10**9 * TEMP_GRACE_S}.tmp",
    }
    (paths["incomplete"] / "blobs").mkdir(parents=True)  # an interrupted prune removed its manifest first
    for t in ("writing", "abandoned"):
        (paths[t] / "blobs").mkdir(parents=True)
        (paths[t] / "blobs" / "cd").write_bytes(b"y" * 50)
    old = time.time() - 2 * TEMP_GRACE_S
    for p in [paths["abandoned"], *paths["abandoned"].rglob("*")]:
        os.utime(p, (old, old))
    (root / "notes.txt").write_text("not edgeprobe's")  # what prepare.py never writes is never listed or removed
    return root, paths


STALE = {"stale", "unrecorded", "incomplete", "calib-stale", "calib-unrecorded", "abandoned"}


def test_list_marks_current_and_stale(fake_cache):
    root, paths = fake_cache
    entries = {e["path"]: e for e in cache_entries()}
    assert set(entries) == {str(p) for p in paths.values()}
    for name, p in paths.items():
        e = entries[str(p)]
        assert e["state"] == {"calib-current": "current", "calib-stale": "stale",
                              "calib-unrecorded": "unrecorded"}.get(name, name), name
        assert e["stale"] == (name in STALE), name
        assert e["bytes"] == _du(p), name
    cur = entries[str(paths["current"])]
    assert (cur["kind"], cur["model"], cur["scheme"], cur["code_version"]) == \
        ("model", "smollm2-135m", "w8a8-shadow", code_version())
    assert entries[str(paths["stale"])]["code_version"] == OLD
    assert entries[str(paths["unrecorded"])]["code_version"] is None
    assert entries[str(paths["calib-current"])]["kind"] == "calibration"


def _tree(root):
    return {p.relative_to(root) for p in root.rglob("*")}


def test_prune_removes_exactly_the_stale(fake_cache):
    root, paths = fake_cache
    before, current_files = _tree(root), _tree(paths["current"])
    would = prune(dry_run=True)
    assert _tree(root) == before  # a dry run removes nothing
    expected_bytes = sum(e["bytes"] for e in cache_entries() if e["stale"])
    removed = prune()
    assert {e["path"] for e in removed} == {e["path"] for e in would} == {str(paths[n]) for n in STALE}
    assert sum(e["bytes"] for e in removed) == expected_bytes
    assert not any(paths[n].exists() for n in STALE)
    kept = {paths["current"], paths["calib-current"], paths["writing"], root / "notes.txt"}
    assert {p for p in root.iterdir()} == kept
    assert _tree(paths["current"]) == current_files  # the current entry untouched
    assert {e["state"] for e in cache_entries()} == {"current", "writing"}
    assert prune() == []  # nothing stale left


def test_prune_all_keeps_only_what_is_being_written(fake_cache):
    root, paths = fake_cache
    removed = prune(all=True)
    assert {e["path"] for e in removed} == {str(p) for n, p in paths.items() if n != "writing"}
    assert set(root.iterdir()) == {paths["writing"], root / "notes.txt"}
    assert (paths["writing"] / "blobs" / "cd").read_bytes() == b"y" * 50


def test_cli_list_and_prune_json(fake_cache):
    """Through the real entry point (python -m edgeprobe): list's JSON fields, then prune --dry-run and prune."""
    root, paths = fake_cache
    env = {**os.environ, "EDGEPROBE_PREPARED_CACHE": str(root)}

    def cli(*argv):
        r = subprocess.run([sys.executable, "-m", "edgeprobe", "cache", *argv], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    listed = cli("list", "--json")
    assert listed["root"] == str(root) and listed["code_version"] == code_version()
    assert {e["path"] for e in listed["entries"]} == {str(p) for p in paths.values()}
    fields = {"path", "name", "kind", "model", "scheme", "bytes", "modified", "modified_iso", "code_version", "state",
              "stale"}
    assert all(set(e) == fields for e in listed["entries"])
    assert listed["bytes"] == sum(e["bytes"] for e in listed["entries"])
    assert listed["stale_bytes"] == sum(e["bytes"] for e in listed["entries"] if e["state"] in
                                        ("stale", "unrecorded", "incomplete", "abandoned"))
    before = _tree(root)
    dry = cli("prune", "--dry-run", "--json")
    assert _tree(root) == before and dry["bytes_freed"] == 0 and dry["bytes"] == listed["stale_bytes"]
    done = cli("prune", "--json")
    assert done["bytes_freed"] == listed["stale_bytes"]
    assert {e["path"] for e in done["removed"]} == {str(paths[n]) for n in STALE}
    assert not any(paths[n].exists() for n in STALE) and paths["current"].exists()


def test_cli_cache_root_a_file_is_one_line_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "f").write_text("")
    monkeypatch.setenv("EDGEPROBE_PREPARED_CACHE", str(tmp_path / "f"))
    assert main(["cache", "list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("edgeprobe: error: ") and "is a file" in err
