"""A real agent whose npu lane runs Hexagon v67 HVX machine code under qemu-hexagon: a 16-token SmolLM2 W8A8
prefill gives the same logits, bit for bit, as the numba backend's NPU-semantics kernels."""
import numpy as np
import pytest

from edgeprobe.device import Device, DeviceError
from edgeprobe.trace import cosine
from edgeprobe_kernels import hvx_bridge

pytestmark = pytest.mark.usefixtures("hvx_toolchain")  # fails, never skips, when the setup did not install it


@pytest.fixture(scope="module")
def qm(smollm):
    from edgeprobe.corpus import read_corpus
    from edgeprobe.quant import calibration_profile, quantize

    prof = calibration_profile(smollm, smollm.tokenizer.encode(read_corpus("train")), tokens=256, window=128,
                               progress=False)
    return quantize(smollm, "w8a8", prof)


def test_w8a8_prefill_on_hexagon_code_equals_the_numba_backend(qm, heldout_ids, tmp_path):
    toks = heldout_ids[:16]
    store = tmp_path / "store"
    with Device.local(store=store, npu_backend="hvx", lanes=["cpu", "npu"]) as dev:
        npu = dev.info["backends"]["npu"]
        assert npu["chosen"] == "hvx" and set(npu["available"]) == {"numba", "hvx"} and npu["emulated"] == "isa"
        hvx = dev.prefill(qm, toks, progress=False)
    with Device.local(store=store, npu_backend="numba", lanes=["cpu", "npu"]) as dev:
        assert dev.info["backends"]["npu"]["chosen"] == "numba"
        ref = dev.prefill(qm, toks, progress=False)
    assert np.array_equal(hvx.logits, ref.logits)  # bit-identical: the int8 path is exact on both
    assert cosine(hvx.logits[0], qm.forward(toks)[-1]) >= 0.9999
    lin = [e for e in hvx.trace.events if e["lane"] == "npu"]
    assert len(lin) == 7 * 30 and all(e["emulated"] == "isa" and e["isa"] == hvx_bridge.ISA for e in lin)
    assert all(e["hvx_packets"] > 0 and e["dsp_cycles_estimate"] == e["hvx_packets"] and e["dsp_clock_hz"] > 0
               for e in lin)
    assert hvx.counters["hvx_packets"] == sum(e["hvx_packets"] for e in lin)
    assert all(e["emulated"] == "semantics" and "isa" not in e for e in ref.trace.events if e["lane"] == "npu")
    assert not any(e["emulated"] for e in hvx.trace.events if e["lane"] == "cpu")


def test_an_agent_asked_for_hvx_without_the_toolchain_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(DeviceError, match="apt-get install clang-15 lld-15 qemu-user"):
        Device.local(store=tmp_path / "s", npu_backend="hvx")
