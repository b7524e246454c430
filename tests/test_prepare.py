"""Calibration and quantized models are prepared once and reused across runs (edgeprobe.prepare)."""
import numpy as np
import pytest

from edgeprobe import models
from edgeprobe.prepare import calibration, prepared


@pytest.fixture(scope="module")
def smol():
    return models.load("smollm2-135m")


def test_calibration_and_quantization_are_reused_and_keyed_by_their_settings(smol, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPROBE_PREPARED_CACHE", str(tmp_path))
    said = []
    a = prepared(smol, "w8a8-shadow", say=said.append, calib_tokens=128)
    assert [m.split(" ")[0] for m in said] == ["calibrating", "calibrated", "quantizing", "prepared"]
    said.clear()
    b = prepared(smol, "w8a8-shadow", say=said.append, calib_tokens=128)
    assert len(said) == 1 and said[0].startswith("reusing w8a8-shadow of smollm2-135m")
    assert a.manifest["blobs"] == b.manifest["blobs"]
    ids = np.arange(100, 116)
    np.testing.assert_array_equal(a.forward(ids, logits="last"), b.forward(ids, logits="last"))
    said.clear()
    c = prepared(smol, "w8a8-shadow", say=said.append, calib_tokens=128, prune_rate=0.0)  # another setting: quantized
    assert [m.split(" ")[0] for m in said] == ["quantizing", "prepared"]  # ... on the calibration already cached
    assert c.manifest["blobs"] != a.manifest["blobs"]
    assert calibration(smol, tokens=128) == calibration(smol, tokens=128)
    assert len(list(tmp_path.glob("calib-*.npz"))) == 1 and len(list(tmp_path.glob("smollm2-135m-w8a8-shadow-*"))) == 2
