"""Calibration and quantized models are prepared once and reused across runs (edgeprobe.prepare)."""
import numpy as np
import pytest

from edgeprobe import models
from edgeprobe.prepare import calibration, prepared


@pytest.fixture(scope="module")
def smol():
    return models.load("smollm2-135m")


def test_calibration_and_quantization_are_reused_and_keyed_by_their_settings(smol, tmp_path, monkeypatch):
    import edgeprobe.quant as quant
    from edgeprobe.corpus import read_corpus

    calibration_profile = quant.calibration_profile  # the real one, for the direct computation at the end

    monkeypatch.setenv("EDGEPROBE_PREPARED_CACHE", str(tmp_path))
    ran = []  # the expensive steps, as they run

    def counted(name):
        real = getattr(quant, name)
        return lambda *a, **k: (ran.append(name), real(*a, **k))[1]

    for name in ("calibration_profile", "quantize"):
        monkeypatch.setattr(quant, name, counted(name))

    def files():
        return {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in tmp_path.rglob("*")}

    a = prepared(smol, "w8a8-shadow", calib_tokens=128)
    assert ran == ["calibration_profile", "quantize"]
    calib, = tmp_path.glob("calib-*.npz")
    entry, = tmp_path.glob("smollm2-135m-w8a8-shadow-*")
    assert (entry / "manifest.json").exists() and len(list(tmp_path.iterdir())) == 2  # no temporary left
    before = files()
    b = prepared(smol, "w8a8-shadow", calib_tokens=128)
    assert ran == ["calibration_profile", "quantize"] and files() == before  # read back, nothing run or written
    assert a.manifest["blobs"] == b.manifest["blobs"]
    ids = np.arange(100, 116)
    np.testing.assert_array_equal(a.forward(ids, logits="last"), b.forward(ids, logits="last"))
    c = prepared(smol, "w8a8-shadow", calib_tokens=128, prune_rate=0.0)  # another setting: quantized again ...
    assert ran == ["calibration_profile", "quantize", "quantize"]  # ... on the calibration already cached
    assert c.manifest["blobs"] != a.manifest["blobs"]
    assert calib.stat().st_mtime_ns == before[calib.relative_to(tmp_path)]
    # the cached calibration is the profile of the first 128 training tokens, computed here directly
    direct = calibration_profile(smol, smol.tokenizer.encode(read_corpus("train")), tokens=128, window=128,
                                 progress=False)
    assert calibration(smol, tokens=128) == direct and ran == ["calibration_profile", "quantize", "quantize"]
    assert len(list(tmp_path.glob("calib-*.npz"))) == 1 and len(list(tmp_path.glob("smollm2-135m-w8a8-shadow-*"))) == 2
