"""A model known by its config.json alone is refused by edgeprobe.prepare before anything is said or written: the
refusal is the command's only output, one line, and no calibration or quantized model is cached."""
from pathlib import Path

import pytest

from edgeprobe import models
from edgeprobe.cli import main
from edgeprobe.errors import ModelFormatError
from edgeprobe.prepare import calibration, prepared

CONFIG = Path(__file__).resolve().parent / "data" / "configs" / "llama-3.2-1b" / "config.json"
REFUSAL = (f"{CONFIG} is a config.json alone (no weights): `edgeprobe schedule` plans from it; this command needs "
           "the checkpoint (a GGUF file or a folder with *.safetensors)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPROBE_PREPARED_CACHE", str(tmp_path / "prepared"))
    return tmp_path / "prepared"


def test_quantize_of_a_config_only_model_prints_the_refusal_alone(cache, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(CONFIG), "--scheme", "w8a8-shadow", "--out", str(out)]) == 2
    got = capsys.readouterr()
    assert got.out == "" and got.err == f"edgeprobe: error: {REFUSAL}\n"
    assert not cache.exists() and not out.exists()  # no calibration, no quantized model, nothing half-written


@pytest.mark.parametrize("scheme", ["w8a8-shadow", "q4_0", "float"])
def test_prepared_and_calibration_refuse_before_saying_anything(cache, scheme):
    m = models.load(CONFIG)
    said = []
    with pytest.raises(ModelFormatError) as e:
        prepared(m, scheme, say=said.append)
    assert str(e.value) == REFUSAL and said == []
    with pytest.raises(ModelFormatError) as e:
        calibration(m, say=said.append, tokens=64)
    assert str(e.value) == REFUSAL and said == [] and not cache.exists()
