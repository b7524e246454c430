"""Layer-major profiling and perplexity (every window through layer i, then layer i + 1) equal the window-major pass
bit for bit: the same ops run on the same inputs, outlier statistics are maxima and integer counts (order-free) and
the windows' NLL sums are added in the same order."""
import json

import numpy as np
import pytest

from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.evaluate import perplexity
from edgeprobe.forward import hook_names
from edgeprobe.profile import OutlierStats, run
from edgeprobe.profile.base import Profile
from edgeprobe.profile.outliers import tensor_names
from edgeprobe.profile.sparsity import SparsityStats
from edgeprobe_kernels.names import layer_of


@pytest.fixture(scope="module")
def tiny_moe():
    return models.load("tiny-moe")


def _equal(a, b):
    assert a.arrays.keys() == b.arrays.keys() and a.arrays
    for name in a.arrays:
        for field, x in a.arrays[name].items():
            y = b.arrays[name][field]
            assert x.dtype == y.dtype and np.array_equal(x, y), (name, field)
    assert (a.tokens, a.windows) == (b.tokens, b.windows)
    assert a == b


class Recorded(Profile):
    """Every hook point's array (router logits: also the routing), per point in call order: what each hook saw."""

    KIND = "recorded"

    def hooks(self, model):
        def observe(name, x):
            got = [np.array(x)] + ([np.array(x.experts), np.array(x.weights)] if hasattr(x, "experts") else [])
            self.arrays.setdefault(name, []).append(got)
        return {n: observe for n in hook_names(model.config)}


@pytest.mark.parametrize("which", ["smollm", "tiny_moe", "gemma"])
def test_layer_major_equals_window_major(which, request):
    """Every hook sees the same arrays bit for bit (router logits and routing of MoE layers too), so any profile
    of them is equal; outlier statistics checked too (dense models: an MoE FFN has no ffn_act point to profile)."""
    model = request.getfixturevalue(which)
    ids = model.tokenizer.encode(read_corpus("train")[:1500])
    kw = dict(window=48, max_tokens=3 * 48, progress=False)
    new = lambda: Recorded(model_name=model.name, model_sha256=model.sha256, params={})  # noqa: E731
    r_win = run(model, ids, new(), **kw)
    r_lay = run(model, ids, new(), order="layer", **kw)
    c = model.config  # an MoE layer's experts have no single ffn_act point
    assert r_win.arrays.keys() == r_lay.arrays.keys() == {n for n in hook_names(c)
                                                          if not (c.n_experts and n.endswith("ffn_act"))}
    for name, calls in r_win.arrays.items():
        assert len(calls) == len(r_lay.arrays[name]) == 3
        for a, b in zip(calls, r_lay.arrays[name]):
            assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b)), name
    assert r_win.corpus_sha256 == r_lay.corpus_sha256 and (r_win.tokens, r_win.windows) == (3 * 48, 3)
    if model.config.n_experts:
        return
    clips = {n: float(np.percentile(np.abs(np.concatenate([c[0] for c in r_win.arrays[n]])), 99.9))
             for n in tensor_names(model)}  # the calibration's clips, exactly, from what the hooks saw
    s_win = run(model, ids, OutlierStats.for_model(model, clips, percentile=99.9), **kw)
    s_lay = run(model, ids, OutlierStats.for_model(model, clips, percentile=99.9), order="layer", **kw)
    _equal(s_win, s_lay)
    assert sum(int(st["count"].sum()) for st in s_win.arrays.values()) > 0  # something was counted


class Held(Recorded):
    """Recorded, plus the tensors the model's weights held when each hook point fired (state, between layers)."""

    KIND = "held"

    def hooks(self, model):
        rec, self.held = super().hooks(model), {}

        def observe(name, x):
            self.held.setdefault(name, set()).update(model.weights.resident())
            rec[name](name, x)
        return {n: observe for n in rec}


@pytest.mark.parametrize("which,name", [("smollm", "smollm2-135m"), ("tiny_moe", "tiny-moe")])
def test_layer_major_holds_one_layer_of_a_lazily_loaded_model(which, name, request):
    """A model loaded lazily (SmolLM2: tensors mapped from the cache; tiny-moe: in memory, no cache) holds, while
    layer i runs, layer i's blk tensors alone (the embedding table only in layer 0), and after the pass nothing the
    pass loaded; its hooks see what the window-major pass over an already loaded model sees, bit for bit. A
    materialized model keeps every tensor."""
    ref = request.getfixturevalue(which)
    lazy = models.load(name)
    assert not lazy.weights.resident()  # nothing held before the pass
    ids = ref.tokenizer.encode(read_corpus("train")[:1500])
    kw = dict(window=48, max_tokens=3 * 48, progress=False)
    r_lay = run(lazy, ids, Held(model_name=lazy.name, model_sha256=lazy.sha256, params={}), order="layer", **kw)
    r_win = run(ref, ids, Recorded(model_name=ref.name, model_sha256=ref.sha256, params={}), **kw)
    assert r_lay.held.keys() == r_win.arrays.keys()
    for point, held in r_lay.held.items():
        layers = {layer_of(n) for n in held if n.startswith("blk.")}
        others = {n for n in held if not n.startswith("blk.")}
        if point.startswith("blk."):
            i = layer_of(point)
            assert layers == {i} and others <= ({"token_embd.weight"} if i == 0 else set()), (point, held)
        else:  # out_norm: every layer released
            assert layers == set() and others == {"output_norm.weight"}, (point, held)
    assert lazy.weights.resident() == frozenset()
    for point, calls in r_win.arrays.items():
        assert len(calls) == len(r_lay.arrays[point]) == 3
        for a, b in zip(calls, r_lay.arrays[point]):
            assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b)), point

    lazy.weights.materialize()
    run(lazy, ids, Recorded(model_name=lazy.name, model_sha256=lazy.sha256, params={}), order="layer", **kw)
    assert lazy.weights.resident() == frozenset(lazy.weights)


class _PerWindowOnly(Recorded):
    """Keeps state between begin_window and end_window without at_window: a layer-major pass would mix windows."""

    def begin_window(self, ids):
        super().begin_window(ids)


@pytest.mark.parametrize("which", ["smollm", "gemma", "tiny_moe"])
def test_per_window_profiles_layer_major_equal_window_major(which, request):
    """Sparsity keeps each window's resident neurons, co-activation each window's routing across layers: both switch
    windows in at_window, so the layer-major profile is the window-major one, bit for bit (float64 error sums
    included: each layer's windows are added in the same order)."""
    from edgeprobe.profile.experts import CoActivationStats
    from edgeprobe.profile.sparsity import calibrate_thresholds

    model = request.getfixturevalue(which)
    ids = model.tokenizer.encode(read_corpus("train")[:1500])
    kw = dict(window=48, max_tokens=3 * 48, progress=False)
    if model.config.n_experts:
        new = lambda: CoActivationStats.for_model(model)  # noqa: E731
    else:
        taus = calibrate_thresholds(model, ids, 0.01, tokens=48)
        new = lambda: SparsityStats.for_model(model, taus, 0.01, act_fn=model.config.act_fn)  # noqa: E731
    win, lay = run(model, ids, new(), **kw), run(model, ids, new(), order="layer", **kw)
    _equal(win, lay)
    assert win.windows == 3 and (win.summary() == lay.summary())
    if model.config.n_experts:
        assert int(win.a["freq"].sum()) == 3 * 48 * model.config.n_layers * model.config.n_experts_used
    else:
        assert all(int(st["fire"].sum()) > 0 for st in win.arrays.values())


def test_layer_major_refuses_per_window_profiles(smollm):
    st = _PerWindowOnly(model_name=smollm.name, model_sha256=smollm.sha256, params={})
    with pytest.raises(ValueError, match="_PerWindowOnly keeps per-window state .* without at_window"):
        run(smollm, np.zeros(128, np.int64), st, window=64, order="layer", progress=False)
    with pytest.raises(ValueError, match="order must be"):
        run(smollm, np.zeros(128, np.int64), window=64, order="tokens", progress=False)


def test_the_outliers_job_and_its_runners_take_the_order(smollm, monkeypatch):
    from edgeprobe.profile import jobs
    from edgeprobe.profile.jobs import profile_outliers

    ids = smollm.tokenizer.encode(read_corpus("train")[:1200])
    kw = dict(tokens=96, window=48, calib_tokens=96, progress=False)
    orders = []
    real = jobs.run
    monkeypatch.setattr(jobs, "run", lambda *a, **k: orders.append((k.get("desc"), k.get("order"))) or real(*a, **k))
    _equal(profile_outliers(smollm, ids, **kw), profile_outliers(smollm, ids, order="layer", **kw))
    # layer-major: its calibration too (a window-major one would hold every layer's weights); the calibration covers
    # every window profiled, so its kept entries stand for the outlier pass (ClipHistograms keep) in either order
    assert orders == [("calibrate", "window"), ("calibrate", "layer")]
    # a runner (RayRunner's place) is asked for both passes in that order; the CLI's layer-major profile on a real
    # Ray cluster: tests/e2e/test_ray_profile.py
    asked = []
    runner = lambda *a, **k: asked.append((k.get("desc"), k.get("order"))) or real(*a, **k)  # noqa: E731
    _equal(profile_outliers(smollm, ids, runner=runner, order="layer", **kw), profile_outliers(smollm, ids, **kw))
    assert asked == [("calibrate", "layer"), ("outliers", "layer")]


@pytest.mark.parametrize("which", ["smollm", "tiny_moe", "gemma"])
def test_layer_major_perplexity_is_the_same_number(which, request):
    """Gemma adds BOS to each window and soft-caps nothing at 270M; tiny-moe routes; SmolLM2 is plain: each the
    same float64 NLL, not merely close. A quantized simulation's linear passes through too (SmolLM2, w8a8)."""
    model = request.getfixturevalue(which)
    ids = model.tokenizer.encode(read_corpus("heldout")[:2000])
    kw = dict(window=40, max_windows=3, progress=False)
    win, lay = perplexity(model, ids, **kw), perplexity(model, ids, order="layer", **kw)
    assert lay.windows == win.windows == 3 and lay.tokens_scored == win.tokens_scored
    assert lay.nll == win.nll and lay.perplexity == win.perplexity and np.isfinite(win.nll)
    if which != "smollm":
        return
    from edgeprobe.quant import calibration_profile, quantize

    calib = calibration_profile(model, model.tokenizer.encode(read_corpus("train")), tokens=128, window=64)
    qm = quantize(model, "w8a8", calib)
    q_win = perplexity(qm.model, ids, linear=qm.linear, **kw)
    q_lay = perplexity(qm.model, ids, linear=qm.linear, order="layer", **kw)
    assert q_lay.nll == q_win.nll != win.nll


def test_eval_cli_takes_the_order(capsys):
    from edgeprobe.cli import main

    args = ["eval", "--window", "32", "--max-windows", "2", "--json", "--no-progress"]
    assert main(args) == 0 and main([*args, "--order", "layer"]) == 0
    win, lay = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines()[-2:])
    assert (win["order"], lay["order"]) == ("window", "layer") and win["nll"] == lay["nll"]
    with pytest.raises(ValueError, match="order must be 'window' or 'layer'"):
        perplexity(models.load("smollm2-135m"), np.arange(100), window=32, order="tokens")
