"""One prepared-model cache (edgeprobe.prepare): a model prepared by one entry point is read back by the others —
shown by the cache's files and by counting calibrations and quantizations, not by what they print."""
import json

import pytest

from edgeprobe import models
from edgeprobe.cli import main
from edgeprobe.prepare import prepared


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
    before = _files(tmp_path)
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
