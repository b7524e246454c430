"""Outlier and sparsity profiles on the real model: kernels vs references, streaming, merging,
saving, derived figures, CLI and bad input."""
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from edgeprobe.errors import StatsFileError, StatsMismatchError, TextError
from edgeprobe.profile import OutlierStats, SparsityStats, calibrate_clips, calibrate_thresholds, run
from edgeprobe.profile.outliers import CHANNEL_CLIP_PERCENTILE, TENSOR_POINTS, _percentile_from_hist, calibrate_clips_at
from edgeprobe.profile.predictor import train_predictors
from edgeprobe_kernels.activation_stats import (
    N_RATIO_BINS,
    NEVER,
    keep_above,
    keep_above_ref,
    log2_histogram,
    outlier_update,
    outlier_update_ref,
    pack_active,
    replay_outliers,
    replay_outliers_ref,
    window_counts,
    window_update_ref,
)

W = 64  # small windows keep the suite fast


@pytest.fixture(scope="module")
def ids(smollm):
    from edgeprobe.corpus import read_corpus

    return smollm.tokenizer.encode(read_corpus("train")[:20000])


@pytest.fixture(scope="module")
def clips(smollm, ids):
    return calibrate_clips(smollm, ids, window=W, max_tokens=4 * W, progress=False)


@pytest.fixture(scope="module")
def taus(smollm, ids):
    return calibrate_thresholds(smollm, ids, eps=0.01, tokens=W)


# ---- kernels ------------------------------------------------------------------------------------

def test_outlier_kernel_matches_reference():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((200, 96)) * rng.exponential(1.0, 96)).astype(np.float32)

    def state(C):
        return [np.zeros(C, np.float32), np.zeros(C, np.int64), np.zeros(C, np.int64),
                np.zeros((C, N_RATIO_BINS), np.int64), np.zeros(C + 1, np.int64), np.zeros(C, bool)]

    a, b = state(96), state(96)
    for _ in range(2):
        outlier_update_ref(x, 2.5, 6.0, *a)
        outlier_update(x, 2.5, 6.0, *b)
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p, q)
    assert a[1].sum() == 2 * (np.abs(x) > 2.5).sum() and a[2].sum() == 2 * (np.abs(x) > 6.0).sum()
    with pytest.raises(ValueError, match="channels"):
        outlier_update(x, 2.5, 6.0, *state(95))


@pytest.mark.parametrize("rows", [200, 300])  # 300: keep_above's row blocks (SPLIT_ROWS)
def test_kept_entries_replay_the_outlier_kernel(rows):
    """keep_above then replay_outliers (the one-pass outlier profile's path) leave outlier_update's state exactly,
    numba against numba and reference against reference, whenever the bar is at most clip / 2; a bar above it
    loses entries the histogram counts."""
    rng = np.random.default_rng(3)
    C, clip, fixed = 96, 2.5, 6.0
    x = (rng.standard_normal((rows, C)) * rng.exponential(1.0, C)).astype(np.float32)
    x[0, :5] = [clip, clip / 2, fixed, -clip, -fixed]  # on every comparison's edge

    def state():
        return [np.zeros(C, np.float32), np.zeros(C, np.int64), np.zeros(C, np.int64),
                np.zeros((C, N_RATIO_BINS), np.int64), np.zeros(C + 1, np.int64), np.zeros(C, bool)]

    for keep, replay, update in ((keep_above, replay_outliers, outlier_update),
                                 (keep_above_ref, replay_outliers_ref, outlier_update_ref)):
        for t in (0.0, 0.3, clip / 2, clip / 2 * 1.01):
            a, b = state(), state()
            for _ in range(2):
                update(x, clip, fixed, *a)
                idx, vals = keep(x, t, fixed, b[0], b[2])
                np.testing.assert_array_equal(idx, np.flatnonzero(np.abs(x) >= t))
                np.testing.assert_array_equal(vals, np.abs(x).ravel()[idx])
                any_out = np.zeros(C, bool)
                replay(idx, vals, rows, C, clip, b[1], b[3], b[4], any_out)
                b[5] |= any_out
            same = [np.array_equal(p, q) for p, q in zip(a, b)]
            if t <= clip / 2:
                assert all(same), (keep.__name__, t, same)
            else:  # |x| = clip / 2 (and any other in [clip/2, t)) is missing from the lowest bin
                assert not same[3] and all(same[:3] + same[4:])


def test_window_counts_match_reference_and_definition():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((40, 30)).astype(np.float32)
    tau = 1.0
    act = np.abs(a) > tau
    K = 5
    s1 = [np.full(30, NEVER, np.int64), np.zeros(30, np.int64), np.zeros(K + 2, np.int64), np.zeros(K + 2, np.int64)]
    for t0, part in ((0, a[:25]), (25, a[25:])):  # one sequence fed in two calls
        window_update_ref(part, tau, s1[0], t0, K, *s1[1:])
    # the bit-parallel version used by SparsityStats gives the same counts
    new, res = np.zeros(K, np.int64), np.zeros(K, np.int64)
    carry = np.zeros((K, 1), np.uint64)
    for part in (a[:25], a[25:]):
        carry = window_counts(pack_active(part, tau), carry, new, res)
    np.testing.assert_array_equal(new, [s1[2][k + 1:].sum() for k in range(1, K + 1)])
    np.testing.assert_array_equal(res, [s1[3][:k].sum() for k in range(1, K + 1)])
    # brute force: new loads and residency for window k
    for k in range(1, K + 1):
        new = sum(act[t, j] and not act[max(0, t - k):t, j].any() for t in range(40) for j in range(30))
        resident = sum(act[max(0, t - k + 1):t + 1, j].any() for t in range(40) for j in range(30))
        assert s1[2][k + 1:].sum() == new
        assert s1[3][:k].sum() == resident


def test_log2_histogram_percentile_is_close_to_exact():
    rng = np.random.default_rng(3)
    x = rng.standard_t(3, size=(4000, 50)).astype(np.float32)
    h = np.zeros(8192, np.int64)
    log2_histogram(x, h)
    assert h.sum() == x.size
    for q in (50, 99, 99.9):
        assert _percentile_from_hist(h, q) == pytest.approx(np.percentile(np.abs(x), q), rel=0.025)


# ---- outliers -----------------------------------------------------------------------------------

def test_outlier_stats_on_real_model(smollm, ids, clips):
    st = run(smollm, ids, OutlierStats.for_model(smollm, clips), window=W, max_tokens=4 * W, progress=False)
    assert st.tokens == 4 * W and st.windows == 4 and len(st.arrays) == 30 * len(TENSOR_POINTS)
    # calibrated on the same tokens: ~0.01% of values are beyond the 99.99th percentile clip
    s = st.summary()
    assert 0 < s["outlier_fraction_of_values"] < 5e-4
    cpl = st.channels_per_layer()
    assert cpl["ffn_act_per_window"].shape == (30,) and (cpl["pct_window"] >= 0).all()
    assert 0 < s["fig11_pct_channels_for_80pct_outliers"] < 50
    # hot channels cover the asked share of each tensor's outliers, and no fewer would
    hot = st.hot_channels(0.8)
    n = "blk.1.attn_in"
    c = st.arrays[n]["count"]
    if c.sum():
        assert c[hot[n]].sum() >= 0.8 * c.sum() > np.sort(c)[::-1][:len(hot[n]) - 1].sum()
    pruned = st.pruned_layers(0.85)
    assert len(pruned) == 25
    imp = st.layer_importance()
    assert max(imp[pruned]) <= min(np.delete(imp, pruned))
    sq = st.smoothquant_scales()
    assert sq["blk.0.ffn_act"].shape == (1536,) and np.all(sq["blk.0.ffn_act"] > 0)


def test_outlier_merge_equals_one_pass_and_save_round_trip(smollm, ids, clips, tmp_path):
    a = run(smollm, ids[:2 * W], OutlierStats.for_model(smollm, clips), window=W, progress=False)
    b = run(smollm, ids[2 * W:4 * W], OutlierStats.for_model(smollm, clips), window=W, progress=False)
    both = run(smollm, ids[:4 * W], OutlierStats.for_model(smollm, clips), window=W, progress=False)
    merged = a.merge(b)
    assert merged == both
    assert merged.summary() == both.summary()
    path = merged.save(tmp_path / "o.npz")
    back = OutlierStats.load(path)
    assert back == merged and back.corpus_sha256 == merged.corpus_sha256 and back.params == merged.params
    meta = json.loads(bytes(np.load(path)["__meta__"]).decode())
    assert meta["model"]["sha256"] == smollm.sha256 and meta["tokens"] == 4 * W and "edgeprobe_version" in meta


@pytest.mark.parametrize("order", ["window", "layer"])
def test_outlier_profile_counts_its_calibration_windows_from_one_pass(smollm, ids, monkeypatch, order):
    """profile_outliers keeps, in the calibration pass, what the outlier pass counts: the windows both cover run
    through the model once, not twice, and the profile is the two-pass one bit for bit (each window's counts, the
    windows' hashes, both clip sets). Past KEEP_BYTES the outlier pass runs again: the same profile."""
    from edgeprobe.profile import jobs, outliers
    from edgeprobe.profile.runner import windows

    passes = []
    real = jobs.run

    def counting(model, tokens, *profiles, **kw):
        passes.append((type(profiles[0]).__name__, len(windows(tokens, kw["window"], kw.get("max_tokens")))))
        return real(model, tokens, *profiles, **kw)
    monkeypatch.setattr(jobs, "run", counting)
    at = calibrate_clips_at(smollm, ids, {99.99, CHANNEL_CLIP_PERCENTILE}, W, 2 * W, progress=False)
    ref = run(smollm, ids, OutlierStats.for_model(smollm, at[99.99], clips_at={CHANNEL_CLIP_PERCENTILE:
                                                                             at[CHANNEL_CLIP_PERCENTILE]}),
              window=W, max_tokens=3 * W, progress=False)
    got = jobs.profile_outliers(smollm, ids, tokens=3 * W, window=W, calib_tokens=2 * W, progress=False, order=order)
    # calibration windows 0-1; window 2 in the same pass (window-major: runner.Handover) or alone after (layer-major)
    assert passes == ([("Handover", 3)] if order == "window" else [("ClipHistograms", 2), ("OutlierStats", 1)])
    assert got == ref and got.corpus_sha256 == ref.corpus_sha256 and got.windows == 3
    assert got.summary() == ref.summary()
    kept = outliers.ClipHistograms.for_model(smollm, keep=99.99)
    run(smollm, ids, kept, window=W, max_tokens=2 * W, progress=False)
    with pytest.raises(ValueError, match="other windows than these 3"):
        OutlierStats.for_model(smollm, kept.clips_at([99.99])[99.99]).replay(kept, windows(ids, W, 3 * W))
    passes.clear()
    monkeypatch.setattr(outliers, "KEEP_BYTES", 1000)
    again = jobs.profile_outliers(smollm, ids, tokens=3 * W, window=W, calib_tokens=2 * W, progress=False,
                                  order=order)
    # window-major, the pass stops as window 2 begins (nothing replayable) and the outlier pass runs all 3
    assert passes == [("Handover" if order == "window" else "ClipHistograms", 3 if order == "window" else 2),
                      ("OutlierStats", 3)] and again == ref


def test_outlier_merge_mismatch(smollm, clips):
    a = OutlierStats.for_model(smollm, clips)
    other_clips = dict(clips, **{"blk.0.attn_in": clips["blk.0.attn_in"] * 2})
    with pytest.raises(StatsMismatchError, match="different thresholds"):
        a.merge(OutlierStats.for_model(smollm, other_clips))
    b = OutlierStats.for_model(smollm, clips)
    b.model_sha256 = "0" * 64
    with pytest.raises(StatsMismatchError, match="different models"):
        a.merge(b)
    with pytest.raises(StatsMismatchError, match="cannot merge"):
        a.merge(SparsityStats(model_name="x", model_sha256=smollm.sha256, params={}))


def test_stats_file_errors(smollm, clips, tmp_path):
    st = OutlierStats.for_model(smollm, clips)
    path = st.save(tmp_path / "o.npz")
    damaged = tmp_path / "damaged.npz"
    damaged.write_bytes(path.read_bytes()[:200])
    with pytest.raises(StatsFileError, match="damaged"):
        OutlierStats.load(damaged)
    with pytest.raises(StatsFileError, match="not 'sparsity'"):
        SparsityStats.load(path)
    # a file of another format version
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(bytes(arrays["__meta__"]).decode())
    meta["format_version"] = 99
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(tmp_path / "v99.npz", **arrays)
    with pytest.raises(StatsFileError, match="version 99"):
        OutlierStats.load(tmp_path / "v99.npz")
    with pytest.raises(StatsFileError, match="no profile"):
        OutlierStats.load(tmp_path / "missing.npz")
    assert zipfile.is_zipfile(path)


def test_figures_are_plotly(smollm, ids, clips, taus):
    st = run(smollm, ids, OutlierStats.for_model(smollm, clips), window=W, max_tokens=W, progress=False)
    for kind in ("channels", "share", "importance", "histogram"):
        fig = st.figure(kind)
        assert fig.data and fig.layout.title.text
    sp = run(smollm, ids, SparsityStats.for_model(smollm, taus), window=W, max_tokens=W, progress=False)
    for kind in ("inactive", "frequency", "window"):
        assert sp.figure(kind).data
    with pytest.raises(ValueError, match="unknown"):
        st.figure("fig99")


# ---- sparsity -----------------------------------------------------------------------------------

def test_sparsity_thresholds_meet_eps(smollm, ids, taus):
    assert len(taus) == 30 and all(t > 0 for t in taus.values())
    st = run(smollm, ids, SparsityStats.for_model(smollm, taus, eps=0.01), window=W, max_tokens=2 * W,
             progress=False)
    err = st.achieved_error()
    # calibrated on the first window, measured on these tokens: close to eps, not far beyond
    assert np.all(err < 0.03) and np.mean(err) > 0.002
    inact = st.inactive_fraction()
    assert np.all((inact > 0) & (inact < 1))
    w = st.window()
    assert np.all(np.diff(w["resident"]) >= 0) and np.all(np.diff(w["new"]) <= 0)
    assert w["resident"][0] == pytest.approx(1536 * (1 - inact.mean()), rel=1e-6)
    assert np.all(w["reads_unbundled"] == 3 * w["reads_bundled"])
    s = st.summary(bits=4)
    assert s["window"]["1"]["flash_bytes_per_token_per_layer"] == pytest.approx(w["new"][0] * 3 * 576 / 2, abs=1)


def test_sparsity_merge_and_round_trip(smollm, ids, taus, tmp_path):
    mk = lambda: SparsityStats.for_model(smollm, taus)
    a = run(smollm, ids[:W], mk(), window=W, progress=False)
    b = run(smollm, ids[W:2 * W], mk(), window=W, progress=False)
    both = run(smollm, ids[:2 * W], mk(), window=W, progress=False)
    assert a.merge(b) == both
    back = SparsityStats.load(both.save(tmp_path / "s.npz"))
    assert back == both and back.summary() == both.summary()
    with pytest.raises(StatsMismatchError, match="different thresholds"):
        a.merge(SparsityStats.for_model(smollm, taus, eps=0.05))


def test_predictor_learns_something(smollm, ids, taus):
    rep = train_predictors(smollm, ids[:2 * W], ids[2 * W:3 * W], taus, rank=8, steps=8, window=W, progress=False)
    assert rep.recall.shape == (30,) and np.all((rep.recall > 0.5) & (rep.recall <= 1))
    assert np.all((rep.precision > 0) & (rep.precision <= 1)) and np.all(rep.ffn_error >= 0)
    # computing every neuron is error-free; the predictor must skip some and stay below total loss
    assert np.all(rep.predicted_fraction < 1) and np.all(rep.ffn_error < 1)


def test_constant_memory_state(smollm, ids, clips):
    st = OutlierStats.for_model(smollm, clips)
    run(smollm, ids, st, window=W, max_tokens=W, progress=False)
    size1 = sum(a.nbytes for f in st.arrays.values() for a in f.values())
    run(smollm, ids[W:], st, window=W, max_tokens=3 * W, progress=False)
    assert sum(a.nbytes for f in st.arrays.values() for a in f.values()) == size1 and st.tokens == 4 * W


# ---- CLI and bad input --------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "edgeprobe", *args], capture_output=True, text=True, timeout=600)


def test_cli_profile_outliers(tmp_path):
    r = _cli("profile", "outliers", "--tokens", "128", "--window", "64", "--out", str(tmp_path), "--json",
             "--no-progress")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["tokens"] == 128 and "fig11_pct_channels_for_80pct_outliers" in summary
    assert json.loads((tmp_path / "summary.json").read_text())["tokens"] == 128
    assert OutlierStats.load(tmp_path / "outliers.npz").tokens == 128
    html = (tmp_path / "outliers_channels.html").read_text()
    assert "plotly" in html.lower() and "<script" in html and 'src="http' not in html  # self-contained


def test_outliers_of_an_moe_model_profile_its_three_points(tmp_path):
    """An MoE layer has no ffn_act (each expert's down projection has its own input): the profile, its summary and
    its figures cover attn_in, attn_out and ffn_in, where a dense model's had a KeyError on the missing point."""
    r = _cli("profile", "outliers", "--model", "tiny-moe", "--tokens", "256", "--window", "128", "--out",
             str(tmp_path), "--json", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    st = OutlierStats.load(tmp_path / "outliers.npz")
    assert st.points == ("attn_in", "attn_out", "ffn_in") and st.tokens == 256
    assert {n.split(".", 2)[2] for n in st.names} == set(st.points) and set(st.arrays) == set(st.names)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert np.isfinite(summary["fig10_outlier_channels_per_window_mean"]) and summary["tokens"] == 256
    assert all((tmp_path / f"outliers_{k}.html").stat().st_size > 0 for k in ("channels",))


def test_cli_profile_sparsity(tmp_path):
    r = _cli("profile", "sparsity", "--tokens", "128", "--window", "64", "--out", str(tmp_path), "--json",
             "--no-progress", "--rank", "4")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0 < summary["inactive_fraction_mean"] < 1 and "predictor" in summary
    assert (tmp_path / "sparsity_window.html").exists()


@pytest.mark.parametrize("content,msg", [
    (b"short text", "fewer than one window"),
    (b"\x00\x01\x02binary\x00" * 50, "binary"),
    ("caf\u00e9 ".encode("latin-1") * 100, "not UTF-8"),
])
def test_cli_profile_bad_corpus(tmp_path, content, msg):
    f = tmp_path / "corpus.txt"
    f.write_bytes(content)
    r = _cli("profile", "outliers", "--corpus", str(f), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


def test_corpus_shorter_than_window_in_library(smollm):
    with pytest.raises(TextError, match="fewer than one window"):
        taus = {f"blk.{i}.{p}": 1.0 for i in range(30) for p in TENSOR_POINTS}
        run(smollm, [1, 2, 3], OutlierStats.for_model(smollm, taus), window=W, progress=False)
