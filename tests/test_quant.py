"""Quantization schemes on the real model: one forward pass, saved manifests, accuracy, bad input."""
import json
import subprocess
import sys

import numpy as np
import pytest

from edgeprobe.errors import ManifestError, StatsMismatchError, UnknownSchemeError
from edgeprobe.evaluate import window_nll
from edgeprobe.forward import forward
from edgeprobe.quant import QuantizedModel, calibration_profile, quantize, schemes_for
from edgeprobe.quant.schemes import input_point

W = 64


@pytest.fixture(scope="module")
def ids(smollm):
    from edgeprobe.corpus import read_corpus

    return smollm.tokenizer.encode(read_corpus("heldout"))[:2 * W]


@pytest.fixture(scope="module")
def profile(smollm):
    from edgeprobe.corpus import read_corpus

    return calibration_profile(smollm, smollm.tokenizer.encode(read_corpus("train")), tokens=4 * W, window=W,
                               progress=False)


@pytest.fixture(scope="module")
def float_logits(smollm, ids):
    return forward(smollm, ids[:W])


@pytest.fixture(scope="module")
def quantized(smollm, profile):
    return {s: quantize(smollm, s, profile if s != "float" else None) for s in schemes_for(smollm.config)}


def _ppl(logits, ids):
    return float(np.exp(window_nll(logits, ids).mean()))


# perplexity over float's on the first W held-out tokens, as measured (2026-11-26, 60333cb; float 53.09): a scheme
# that drifts 3% either way computes something else than it did. smoothquant: 1.622 since e83b717 (a prompt's K and
# V projections became two column blocks, moving the calibration's last bits; SmoothQuant on SmolLM2 follows such
# bits between 1.47 and 1.62, the other schemes within 3%; the same bits at any thread count since d14be05)
PPL_OVER_FLOAT = {"float": 1.0, "w8a8": 9.846, "w8a8-shadow": 1.370, "w8a8c-shadow": 1.009, "smoothquant": 1.622,
                  "llm-int8": 1.053, "q4_0": 1.065, "q4_0-tile": 1.288}
# SmoothQuant's smoothing scales and LLM.int8's |x| > 6 outlier columns follow the calibration's last float bits,
# which differ by CPU: on a Zen 4 EPYC (llvmlite znver4, 2026-12-02) the same code gives 1.529 and 1.013 where the
# Zen 5 one above gave 1.622 and 1.053 (every other scheme within 2%): the range seen, not one machine's figure
PPL_RANGE = {"smoothquant": (1.45, 1.65), "llm-int8": (1.0, 1.07)}


def test_every_scheme_runs_through_the_one_forward_pass(smollm, ids, quantized, float_logits):
    base = _ppl(float_logits, ids[:W])
    assert set(quantized) == set(PPL_OVER_FLOAT)  # a new scheme gets its measured row here
    for scheme, qm in quantized.items():
        logits = qm.forward(ids[:W])
        assert logits.shape == float_logits.shape and np.isfinite(logits).all(), scheme
        ppl = _ppl(logits, ids[:W])
        if scheme == "float":
            np.testing.assert_allclose(logits, float_logits, atol=1e-4)
        elif scheme in PPL_RANGE:
            lo, hi = PPL_RANGE[scheme]
            assert lo <= ppl / base <= hi, (scheme, ppl, base)
        else:
            assert ppl / base == pytest.approx(PPL_OVER_FLOAT[scheme], rel=0.03), (scheme, ppl, base)
    # the shadow outliers repair what plain per-tensor W8A8 breaks
    assert _ppl(quantized["w8a8-shadow"].forward(ids[:W]), ids[:W]) < _ppl(quantized["w8a8"].forward(ids[:W]), ids[:W])


def test_w8a8_linear_is_the_integer_formula(smollm, quantized, profile):
    qm = quantized["w8a8"]
    rec = qm.manifest["linears"]["blk.2.ffn_up"]
    x = np.random.default_rng(0).standard_normal((5, 576)).astype(np.float32)
    sa, sw = rec["scale_a"], rec["scale_w"]
    assert sa == pytest.approx(profile.params["clips"][input_point("blk.2.ffn_up")] / 127)
    xq = np.clip(np.rint(x / sa), -127, 127)
    wq = np.clip(np.rint(smollm.weights["blk.2.ffn_up.weight"] / sw), -127, 127)
    expect = (xq.astype(np.int64) @ wq.astype(np.int64).T).astype(np.float32) * np.float32(sa * sw)
    np.testing.assert_allclose(qm.linear("blk.2.ffn_up", x), expect, rtol=1e-6, atol=1e-6)


def test_channel_shadow_is_per_channel_int8_plus_every_outlier_in_float(smollm, quantized, profile, ids,
                                                                         independent_linear):
    """w8a8c-shadow: per-output-channel weight scales, the activation clip at p99.1, no pruning."""
    from edgeprobe.profile.outliers import CHANNEL_CLIP_PERCENTILE

    qm = quantized["w8a8c-shadow"]
    name = "blk.2.ffn_down"
    rec, point = qm.manifest["linears"][name], input_point(name)
    assert rec["clip"] == pytest.approx(profile.clips_at(CHANNEL_CLIP_PERCENTILE)[point])
    assert rec["clip"] < profile.params["clips"][point] and rec["scale_a"] == pytest.approx(rec["clip"] / 127)
    assert all(r["shadow"] for n, r in qm.manifest["linears"].items())  # no layer pruned
    sw = qm.store.get(rec["scale_w_ch"])
    assert sw.shape == (rec["shape"][0],) and np.unique(sw).size > rec["shape"][0] // 2  # one scale per channel
    x = np.random.default_rng(1).standard_normal((6, rec["shape"][1])).astype(np.float32) * rec["clip"] / 3
    x[2, 7], x[4, 100] = 20 * rec["clip"], -9 * rec["clip"]  # outliers for the shadow GEMM
    ref = independent_linear(qm, smollm)(name, x)
    np.testing.assert_allclose(qm.linear(name, x), ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
    with pytest.raises(ValueError, match="percentiles"):  # a percentile the profile lacks is refused
        profile.clips_at(97.5)
    # per-channel scales and the tight clip beat the paper's per-tensor variant on held-out text
    assert _ppl(qm.forward(ids[:W]), ids[:W]) < _ppl(quantized["w8a8-shadow"].forward(ids[:W]), ids[:W])


def test_shadow_bytes_and_pruning(smollm, profile, ids):
    qm = quantize(smollm, "w8a8-shadow", profile, prune_rate=0.85, coverage=0.8)
    b = qm.nbytes()
    assert 0 < b["shadow_resident"] < b["shadow_flash"]
    pruned = set(profile.pruned_layers(0.85))
    shadows = {n: r["shadow"] for n, r in qm.manifest["linears"].items()}
    assert all(not s for n, s in shadows.items() if int(n.split(".")[1]) in pruned)
    assert sum(shadows.values()) == 7 * (30 - len(pruned))
    none_pruned = quantize(smollm, "w8a8-shadow", profile, prune_rate=0.0)
    assert all(r["shadow"] for r in none_pruned.manifest["linears"].values())
    none_pruned.forward(ids[:W])
    assert none_pruned.counters["outliers"] > 0


def test_accuracy_table_keeps_its_quantized_models_and_reuses_them(smollm, profile, ids, quantized):
    from edgeprobe.quant.report import accuracy_table

    shadow = quantized["w8a8-shadow"]  # other tests ran it: its counters are not at zero
    kept = {"w8a8-shadow": shadow}
    kw = dict(window=W, max_windows=1, progress=False, quantized=kept)
    rows = accuracy_table(smollm, ids, profile, ["float", "w8a8-shadow"], **kw)
    assert kept["w8a8-shadow"] is shadow and kept["float"].scheme == "float"  # reused as given; the other one kept
    again = accuracy_table(smollm, ids, profile, ["float", "w8a8-shadow"], **kw)
    # a reused model computes the same and counts from zero: the same shadow reads and float share each time
    fresh = accuracy_table(smollm, ids, profile, ["w8a8-shadow"], window=W, max_windows=1, progress=False)[0]
    for r in (rows[1], again[1]):
        assert r["cold_bytes_read"] == fresh["cold_bytes_read"] > 0 and r["perplexity"] == fresh["perplexity"]
        assert r["channels_in_float_pct"] == fresh["channels_in_float_pct"] > 0
    assert rows[0]["perplexity"] == again[0]["perplexity"] and rows[0]["channels_in_float_pct"] == 100


def test_save_load_round_trip_and_damage(smollm, quantized, ids, tmp_path):
    qm = quantized["q4_0-tile"]
    qm.save(tmp_path / "q")
    back = QuantizedModel.load(tmp_path / "q")
    np.testing.assert_array_equal(back.forward(ids[:16]), qm.forward(ids[:16]))
    man = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert man["scheme"] == "q4_0-tile" and man["model"]["sha256"] == smollm.sha256
    rec = man["linears"]["blk.0.attn_k"]
    assert rec["padded"] == [576, 192] and rec["padding"] is False
    blob = tmp_path / "q" / "blobs" / rec["blocks"]
    raw = bytearray(blob.read_bytes())
    raw[100] ^= 0xFF
    blob.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="sha256"):
        QuantizedModel.load(tmp_path / "q")
    blob.unlink()
    with pytest.raises(ManifestError, match="missing"):
        QuantizedModel.load(tmp_path / "q")
    with pytest.raises(ManifestError, match="no manifest"):
        QuantizedModel.load(tmp_path)


def test_quantize_into_a_folder_writes_as_it_goes_and_holds_no_model(smollm, profile, quantized, ids, tmp_path):
    """quantize(out=): every blob on disk as it is made, none held; each float tensor the model loaded for it
    released again (issue 43: an 8B model's blobs are ~9 GB); the same model as the in-memory quantization."""
    from edgeprobe import models

    lazy = models.load("smollm2-135m")  # its own LazyWeights: nothing held yet
    assert lazy.sha256 == smollm.sha256 and not lazy.weights.resident()
    qm = quantize(lazy, "w8a8-shadow", profile, out=tmp_path / "q")
    mem = quantized["w8a8-shadow"]
    assert not qm.store.arrays and not lazy.weights.resident()
    assert json.dumps(qm.manifest, sort_keys=True) == json.dumps(mem.manifest, sort_keys=True)
    assert {p.name for p in (tmp_path / "q" / "blobs").iterdir()} == set(mem.store.meta)
    for sha in mem.store.meta:
        got = qm.store.get(sha)
        assert got.dtype == mem.store.get(sha).dtype and np.array_equal(got, mem.store.get(sha)), sha
        assert not got.flags.writeable
    np.testing.assert_array_equal(QuantizedModel.load(tmp_path / "q").forward(ids[:16]), mem.forward(ids[:16]))
    # sealed (prepare.prepared, once its entry is published): later blobs stay in memory, the folder is left alone
    qm.store.seal(tmp_path / "q" / "blobs")
    extra = qm.store.put(np.arange(7, dtype=np.float32), "extra")
    assert np.array_equal(qm.store.get(extra), np.arange(7)) and not (tmp_path / "q" / "blobs" / extra).exists()
    (tmp_path / "q" / "blobs" / next(iter(mem.store.meta))).unlink()
    with pytest.raises(ManifestError, match="cannot be read from .*; quantize again"):
        qm.store.get(next(iter(mem.store.meta)))


def test_padding_recorded_for_shapes_that_do_not_tile(independent_linear):
    from types import SimpleNamespace

    from edgeprobe.quant.blobs import BlobStore
    from edgeprobe.quant.schemes import build_q4_0_tile
    from edgeprobe_kernels.linear_records import run_q4_0_tile

    w = np.random.default_rng(1).standard_normal((50, 70)).astype(np.float32)
    store = BlobStore()
    rec = build_q4_0_tile("blk.0.ffn_up", w, {}, store)
    assert rec["padding"] is True and rec["padded"] == [96, 64]
    x = np.random.default_rng(2).standard_normal((3, 70)).astype(np.float32)
    y = run_q4_0_tile(rec, store.get, {})(x)
    # independent: the tile layout from its spec, each group through gguf-py's Q4_0 (conftest.reference_linear);
    # its weights read back through it on the identity, then rounded to the FP16 the npu lane keeps them in
    ref = independent_linear(SimpleNamespace(manifest={"linears": {"blk.0.ffn_up": rec}}),
                             SimpleNamespace(linear_weight=lambda name: w))
    w16 = ref("blk.0.ffn_up", np.eye(70, dtype=np.float32)).T.astype(np.float16).astype(np.float64)
    expect = x.astype(np.float16).astype(np.float64) @ w16.T
    # the same products; float32 sums in BLAS's order against float64 ones (1.5e-7 of the largest seen)
    assert y.shape == (3, 50) and np.abs(y - expect).max() <= 1e-6 * np.abs(expect).max()


def test_bad_input(smollm, profile):
    with pytest.raises(UnknownSchemeError, match="unknown scheme 'w3a3'"):
        quantize(smollm, "w3a3", profile)
    with pytest.raises(ValueError, match="needs an outlier profile"):
        quantize(smollm, "w8a8")
    other = type(profile)(model_name="other", model_sha256="0" * 64, params=profile.params, arrays=profile.arrays)
    with pytest.raises(StatsMismatchError, match="belongs to model other"):
        quantize(smollm, "w8a8-shadow", other)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "edgeprobe", *args], capture_output=True, text=True, timeout=900)


def test_cli_eval_scheme_and_report(tmp_path, smollm):
    text = tmp_path / "t.txt"
    from edgeprobe.corpus import read_corpus

    text.write_text(read_corpus("heldout")[:3000])
    r = _cli("eval", "--scheme", "q4_0", "--text", str(text), "--window", "64", "--max-windows", "2", "--json",
             "--no-progress")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # the command's number is the in-process evaluation of the same text, windows and scheme (float's differs)
    from edgeprobe.evaluate import perplexity

    tokens = smollm.tokenizer.encode(text.read_text())
    q4 = perplexity(smollm, tokens, window=64, max_windows=2, linear=quantize(smollm, "q4_0").linear, progress=False)
    flt = perplexity(smollm, tokens, window=64, max_windows=2, progress=False)
    # (the same kernels in another process: BLAS may split its sums otherwise, 3e-8 seen)
    assert out["scheme"] == "q4_0" and out["perplexity"] == pytest.approx(q4.perplexity, rel=1e-6)
    assert out["perplexity"] != pytest.approx(flt.perplexity, rel=1e-3) and out["tokens_scored"] == 2 * 63
    r = _cli("quantize", "--report", "--schemes", "float,w8a8-shadow,q4_0-tile", "--text", str(text), "--window", "64",
             "--max-windows", "1", "--calib-tokens", "128", "--json", "--no-progress")
    assert r.returncode == 0, r.stderr
    rows = {row["scheme"]: row for row in json.loads(r.stdout.strip().splitlines()[-1])["rows"]}
    assert rows["float"]["top1_agreement"] == 1.0 and rows["float"]["delta_vs_float_pct"] == 0.0
    assert rows["w8a8-shadow"]["shadow_flash_bytes"] > 0
    assert rows["q4_0-tile"]["weight_bytes"] < rows["float"]["weight_bytes"] / 6
    r = _cli("eval", "--scheme", "w3a3", "--text", str(text))
    assert r.returncode == 2 and "unknown scheme" in r.stderr and "Traceback" not in r.stderr


def test_cli_quantize_out_writes_a_loadable_model(tmp_path, smollm):
    r = _cli("quantize", "--scheme", "w8a8-shadow", "--out", str(tmp_path / "q"), "--calib-tokens", "128",
             "--window", "64", "--no-progress")
    assert r.returncode == 0, r.stderr
    qm = QuantizedModel.load(tmp_path / "q")
    assert qm.scheme == "w8a8-shadow" and qm.nbytes()["shadow_flash"] > 0
    assert qm.forward(smollm.tokenizer.encode("The capital of France is"), logits="last").shape == (49152,)
    r = _cli("quantize")
    assert r.returncode == 2 and "--report" in r.stderr
