"""Mixture of experts end to end on the committed tiny-moe checkpoint: loading (HF and GGUF), the MoE
forward pass against transformers' Mixtral, routing statistics, per-expert widths, expert buffers."""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.errors import ModelFormatError, UnsupportedModelError
from edgeprobe.evaluate import window_nll
from edgeprobe.forward import forward, linear_names, route
from edgeprobe.models import Model, ModelConfig
from edgeprobe.models.weights import LazyWeights
from edgeprobe.profile.experts import CoActivationStats, record_routing
from edgeprobe.profile.runner import run

FOLDER = Path(__file__).resolve().parents[1] / "datasets" / "moe" / "tiny-moe"


@pytest.fixture(scope="module")
def moe():
    return models.load("tiny-moe")


@pytest.fixture(scope="module")
def train_ids(moe):
    return moe.tokenizer.encode(read_corpus("train"))


@pytest.fixture(scope="module")
def held_ids(moe):
    return moe.tokenizer.encode(read_corpus("heldout"))


# ---- the checkpoint -----------------------------------------------------------------------------

def test_committed_checkpoint_matches_its_recorded_heldout_loss(moe, held_ids):
    metrics = json.loads((FOLDER / "metrics.json").read_text())
    seq = metrics["heldout"]["window"]
    assert moe.config.n_experts == 8 and moe.config.n_experts_used == 2 and moe.config.n_layers >= 4
    assert sum(f.stat().st_size for f in FOLDER.iterdir()) < 30e6
    # the training script's windows: seq+1 tokens, scoring seq positions, stepping by seq
    nll, n = 0.0, 0
    for s in range(0, len(held_ids) - seq - 1, seq):
        chunk = held_ids[s:s + seq + 1]
        nll += float(window_nll(forward(moe, chunk), chunk).sum())
        n += seq
    assert n == metrics["heldout"]["tokens"]
    assert abs(nll / n - metrics["heldout"]["loss"]) < 2e-3
    assert nll / n < math.log(moe.config.vocab_size) - 2  # it learned something: far below uniform


def test_routing_is_non_trivial(moe, train_ids):
    st = run(moe, train_ids, CoActivationStats.for_model(moe), window=256, max_tokens=2048, progress=False)
    lb = st.load_balance()
    assert (lb["load_entropy_bits"] > 2.0).all()  # no collapse onto a couple of experts (even = 3 bits)
    assert (lb["max_over_mean"] < 3.0).all()
    assert (lb["router_entropy_bits"] < 2.9).all()  # routers are decided, not uniform (3 bits)


def test_matches_transformers_mixtral(moe, held_ids):
    import torch  # test extra: never skipped
    from transformers import MixtralForCausalLM

    ref_model = MixtralForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    ids = held_ids[:96]
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    ours = forward(moe, ids)
    assert np.abs(ours - ref).max() < 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_gguf_copy_gives_the_same_logits(moe, held_ids, tmp_path):
    from edgeprobe.models.gguf_writer import write_gguf

    path = write_gguf(moe, tmp_path / "tiny-moe.gguf")
    g = models.load(path, cache_dir=False)
    assert g.config.n_experts == moe.config.n_experts and g.config.n_experts_used == moe.config.n_experts_used
    assert "blk.0.ffn_up_exps.weight" in g.weights
    text = "def f(x):\n    return x ** 2  # 12345"
    assert np.array_equal(g.tokenizer.encode(text), moe.tokenizer.encode(text))
    assert np.array_equal(forward(g, held_ids[:64]), forward(moe, held_ids[:64]))
    # without a .npy cache each expert was read alone from its rows of the stack (issue 43: a Mixtral-8x7B stack is
    # 1.9 GB of float32, an expert 235 MB), the same bits as the stack's slice
    held = g.weights.resident()
    assert "blk.0.ffn_up_exps.weight" not in held and "blk.0.ffn_up_exps.weight#0" in held
    down = "blk.1.ffn_down_exps.weight"
    for e in range(moe.config.n_experts):
        assert np.array_equal(g.weights.part(down, e), moe.weights[down][e])
    g.weights.release([down])
    assert not any(k.startswith(down) for k in g.weights.resident())


# ---- the MoE layer --------------------------------------------------------------------------------

def _toy_moe(shared: bool, norm_topk: bool, k: int = 2) -> Model:
    rng = np.random.default_rng(0)
    cfg = ModelConfig(arch="llama", n_layers=2, hidden=16, ffn=12, n_heads=2, n_kv_heads=1, head_dim=8,
                      vocab_size=32, n_experts=4, n_experts_used=k, expert_ffn=12, norm_topk=norm_topk,
                      shared_expert_ffn=10 if shared else 0, shared_expert_gate=shared)
    h, f, E = 16, 12, 4
    w = {"token_embd.weight": rng.normal(size=(32, h)), "output_norm.weight": np.ones(h)}
    for i in range(2):
        w.update({f"blk.{i}.attn_norm.weight": np.ones(h), f"blk.{i}.ffn_norm.weight": np.ones(h),
                  f"blk.{i}.attn_q.weight": rng.normal(size=(16, h)) * .3,
                  f"blk.{i}.attn_k.weight": rng.normal(size=(8, h)) * .3,
                  f"blk.{i}.attn_v.weight": rng.normal(size=(8, h)) * .3,
                  f"blk.{i}.attn_output.weight": rng.normal(size=(h, 16)) * .3,
                  f"blk.{i}.ffn_gate_inp.weight": rng.normal(size=(E, h)),
                  f"blk.{i}.ffn_gate_exps.weight": rng.normal(size=(E, f, h)) * .3,
                  f"blk.{i}.ffn_up_exps.weight": rng.normal(size=(E, f, h)) * .3,
                  f"blk.{i}.ffn_down_exps.weight": rng.normal(size=(E, h, f)) * .3})
        if shared:
            w.update({f"blk.{i}.ffn_gate_shexp.weight": rng.normal(size=(10, h)) * .3,
                      f"blk.{i}.ffn_up_shexp.weight": rng.normal(size=(10, h)) * .3,
                      f"blk.{i}.ffn_down_shexp.weight": rng.normal(size=(h, 10)) * .3,
                      f"blk.{i}.ffn_gate_inp_shexp.weight": rng.normal(size=(1, h))})
    loaders = {n: (lambda a=a: np.asarray(a, np.float32)) for n, a in w.items()}
    return Model(config=cfg, tokenizer=None, weights=LazyWeights(loaders, None), source="toy", sha256="0" * 64,
                 name="toy")


def _reference_moe_ffn(m: Model, i: int, x: np.ndarray) -> np.ndarray:
    """Token by token, softmax over all experts then top-k, written out plainly."""
    c, W = m.config, m.weights
    silu = lambda v: v / (1 + np.exp(-v))
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(len(x)):
        logits = W[f"blk.{i}.ffn_gate_inp.weight"] @ x[t]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:c.n_experts_used]
        g = p[top] / p[top].sum() if c.norm_topk else p[top]
        for e, ge in zip(top, g):
            a = silu(W[f"blk.{i}.ffn_gate_exps.weight"][e] @ x[t]) * (W[f"blk.{i}.ffn_up_exps.weight"][e] @ x[t])
            out[t] += ge * (W[f"blk.{i}.ffn_down_exps.weight"][e] @ a)
        if c.shared_expert_ffn:
            a = silu(W[f"blk.{i}.ffn_gate_shexp.weight"] @ x[t]) * (W[f"blk.{i}.ffn_up_shexp.weight"] @ x[t])
            gate = 1 / (1 + np.exp(-(W[f"blk.{i}.ffn_gate_inp_shexp.weight"] @ x[t])[0]))
            out[t] += gate * (W[f"blk.{i}.ffn_down_shexp.weight"] @ a)
    return out


@pytest.mark.parametrize("shared,norm_topk,k", [(False, True, 2), (True, False, 2), (True, True, 1)])
def test_moe_layer_matches_a_plain_reference(shared, norm_topk, k):
    m = _toy_moe(shared, norm_topk, k)
    seen = {}
    grab = lambda n, x: seen.__setitem__(n, np.array(x))
    out = "blk.1.ffn_moe_sum" if shared else "blk.1.moe_ffn"  # the template op whose output is the layer's FFN
    forward(m, np.arange(7), hooks={"blk.1.ffn_in": grab, out: grab})
    x = seen["blk.1.ffn_in"]
    assert x.shape == (7, 16)
    assert np.allclose(seen[out], _reference_moe_ffn(m, 1, x), rtol=1e-5, atol=1e-5)


def test_router_hook_sees_logits_and_chosen_experts_and_can_reroute(moe, held_ids):
    ids = held_ids[:32]
    seen = {}

    def look(name, x):
        seen[name] = (np.array(x), x.experts.copy(), x.weights.copy())

    base = forward(moe, ids, hooks={f"blk.{i}.router": look for i in range(moe.config.n_layers)})
    logits, experts, weights = seen["blk.0.router"]
    assert logits.shape == (32, moe.config.n_experts) and experts.shape == (32, 2)
    e2, w2 = route(logits, 2, True)
    assert np.array_equal(experts, e2) and np.allclose(weights.sum(1), 1) and np.allclose(weights, w2)
    assert (np.take_along_axis(logits, experts[:, :1], 1)[:, 0] == logits.max(1)).all()

    def force(name, x):  # route every token to experts 0 and 1 in layer 0
        y = np.array(x)
        y[:, :2] += 100.0
        return y
    forced = {}
    keep = lambda n, x: forced.__setitem__(n, x.experts)
    out = forward(moe, ids, hooks={"blk.0.router": force, "blk.1.router": keep})
    assert not np.allclose(out, base)
    assert len(forced) == 1


def test_linear_names_cover_every_expert(moe):
    names = linear_names(moe.config)
    c = moe.config
    assert len(names) == c.n_layers * (4 + 1 + 3 * c.n_experts)
    assert moe.linear_weight("blk.2.ffn_down_exps.5").shape == (c.hidden, c.expert_ffn)
    assert np.array_equal(moe.linear_weight("blk.2.ffn_up_exps.5"), moe.weights["blk.2.ffn_up_exps.weight"][5])


# ---- bad checkpoints ------------------------------------------------------------------------------

def _copy(tmp_path) -> Path:
    dst = tmp_path / "moe"
    shutil.copytree(FOLDER, dst)
    return dst


def _edit_config(folder: Path, **kw) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(kw)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_router_and_expert_shapes_that_disagree_are_named(tmp_path):
    d = _copy(tmp_path)
    _edit_config(d, intermediate_size=128)
    with pytest.raises(ModelFormatError, match="ffn_gate_exps.*disagree"):
        models.load(d)
    d2 = tmp_path / "moe2"
    shutil.copytree(FOLDER, d2)
    _edit_config(d2, num_local_experts=6)
    with pytest.raises(ModelFormatError, match="num_local_experts = 6"):
        models.load(d2)


def test_topk_larger_than_the_experts_is_refused(tmp_path):
    d = _copy(tmp_path)
    _edit_config(d, num_experts_per_tok=9)
    with pytest.raises(ModelFormatError, match="top-k = 9.*8 experts"):
        models.load(d)


def test_dense_model_given_to_the_experts_profiler(smollm, tmp_path):
    with pytest.raises(UnsupportedModelError, match="dense.*tiny-moe"):
        CoActivationStats.for_model(smollm)
    r = subprocess.run([sys.executable, "-m", "edgeprobe", "profile", "experts", "--model", "smollm2-135m",
                        "--out", str(tmp_path / "never"), "--tokens", "512"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "dense" in r.stderr and "Traceback" not in r.stderr


# ---- co-activation statistics --------------------------------------------------------------------

@pytest.fixture(scope="module")
def coact(moe, train_ids):
    return run(moe, train_ids, CoActivationStats.for_model(moe), window=256, max_tokens=4096, progress=False)


@pytest.fixture(scope="module")
def held_trace(moe, held_ids):
    return record_routing(moe, held_ids, 256, 2048, progress=False)


def test_coactivation_streams_merges_and_saves(moe, train_ids, coact, tmp_path):
    a = run(moe, train_ids[:2048], CoActivationStats.for_model(moe), window=256, progress=False)
    b = run(moe, train_ids[2048:4096], CoActivationStats.for_model(moe), window=256, progress=False)
    merged = a.merge(b)
    for f in ("freq", "top1", "c1", "c2", "n2", "paths"):
        assert np.array_equal(merged.a[f], coact.a[f]), f
    assert np.allclose(merged.a["entropy"], coact.a["entropy"])
    trace = record_routing(moe, train_ids, 256, 4096, progress=False)
    from_trace = CoActivationStats.for_model(moe).add_trace(trace)
    assert np.array_equal(from_trace.a["c2"], coact.a["c2"]) and from_trace.tokens == coact.tokens
    coact.save(tmp_path / "c.npz")
    assert CoActivationStats.load(tmp_path / "c.npz") == coact
    assert coact.a["freq"].sum() == coact.tokens * moe.config.n_layers * 2
    assert coact.a["paths"].sum() == coact.tokens


def test_conditional_tables_and_paths(coact):
    p1 = coact.conditional(3, 1)
    seen = coact.a["top1"][2] > 0
    assert np.allclose(np.nansum(p1[seen], axis=1), 2.0)  # k = 2 experts chosen per token
    p2 = coact.conditional(3, 2)
    assert np.nanmax(p2) <= 1.0
    peak = coact.conditional_peak(2)
    assert np.isnan(peak[:2]).all() and (peak[2:] > 1.0 / 8).all()
    pl = coact.power_law()
    assert pl["paths_observed"] <= coact.tokens and pl["alpha"] > 0 and 0 < pl["r2"] <= 1


def test_path_coverage_counts_the_routed_paths(moe, train_ids, coact):
    """The top-20% paths' token share, against the top-1 paths of a routing trace of the same tokens."""
    trace = record_routing(moe, train_ids, 256, 4096, progress=False)
    P = coact.params["path_layers"]
    _, counts = np.unique(trace.experts[:, :P, 0], axis=0, return_counts=True)
    counts = np.sort(counts)[::-1]
    assert coact.power_law()["paths_observed"] == len(counts) and counts.sum() == coact.tokens
    top = counts[:int(np.ceil(0.2 * len(counts)))].sum() / counts.sum()
    assert coact.path_coverage(0.2) == pytest.approx(top, rel=1e-12)
    assert coact.path_coverage(1.0) == 1.0


def test_preload_predictor_beats_frequency_and_random(coact, held_trace):
    h0 = coact.predictor(0).hit_rate(held_trace, 2)
    h2 = coact.predictor(2).hit_rate(held_trace, 2)
    assert h2["mean"] > h0["mean"] > h2["random"]
    assert coact.predictor(2).hit_rate(held_trace, 8)["mean"] == 1.0
    summary = coact.summary(held_trace)
    json.dumps(summary)
    assert summary["predictor_hit_rate"]["order2"]["top2"] == h2["mean"]


def test_coactivation_figures_draw(coact, held_trace):
    for kind in ("frequency", "paths", "conditional"):
        assert coact.figure(kind).data
    assert len(coact.figure("predictor", heldout=held_trace).data) == 4


# ---- per-expert bit widths -----------------------------------------------------------------------

def test_intn_per_channel_round_trip():
    from edgeprobe_kernels.intn import dequantize_channels, packed_bytes, quantize_channels

    rng = np.random.default_rng(0)
    w = rng.normal(size=(5, 37)).astype(np.float32)
    for bits in (2, 4, 8):
        codes, s = quantize_channels(w, bits)
        assert codes.nbytes == packed_bytes(5, 37, bits) and s.dtype == np.float16
        d = dequantize_channels(codes, s, bits, 37)
        qmax = 2 ** (bits - 1) - 1
        assert np.abs(d - w).max() <= (s.astype(np.float32).max() * 0.5 + 1e-3)
        assert len(np.unique(np.round(d[0] / s[0].astype(np.float32)))) <= 2 * qmax + 1
        assert np.allclose(dequantize_channels(*quantize_channels(d, bits), bits, 37), d, atol=1e-3)
    with pytest.raises(ValueError, match="bits"):
        quantize_channels(w, 3)


@pytest.fixture(scope="module")
def study(moe, train_ids):
    from edgeprobe.quant import ExpertBitsStudy

    s = ExpertBitsStudy(moe, train_ids, window=128, max_windows=2, progress=False)
    s.measure_sensitivity()
    return s


def test_int2_sensitivity_and_selection(study, moe):
    assert study.sensitivity.shape == (moe.config.n_layers, 8)
    assert study.uniform[2] > study.uniform[4] >= study.float_loss - 1e-3
    assert (study.sensitivity > -0.02).all() and study.sensitivity.max() > 0
    tight, loose = study.select(0.0), study.select(1.0)
    assert tight.k_low <= loose.k_low and tight.model_bytes >= loose.model_bytes
    sel = study.select(0.05)
    assert sel.reachable and sel.perplexity_increase <= 0.05 + 1e-9
    ranking = study.ranking()
    low = {n for n, b in sel.bits.items() if b == sel.low}
    assert low == {n for le in ranking[:sel.k_low] for n in
                   (f"blk.{le[0]}.ffn_{op}_exps.{le[1]}" for op in ("gate", "up", "down"))} or sel.low == sel.high
    assert study.figure("sensitivity").data and study.figure("tolerance", [tight, sel, loose]).data


def test_moe_mixed_scheme_runs_what_the_study_measured(study, moe, train_ids, tmp_path):
    from edgeprobe.quant import QuantizedModel, quantize

    sel = study.select(0.05)
    qm = quantize(moe, "moe-mixed", expert_bits=sel.bits)
    nll = sum(float(window_nll(qm.forward(c), c).sum()) for c in study.chunks) / study.tokens
    assert abs(nll - sel.loss) < 1e-6
    assert qm.nbytes()["linear_weights"] + qm.nbytes()["float_tensors"] >= sel.expert_bytes
    bits = [r["bits"] for n, r in qm.manifest["linears"].items() if "_exps." in n]
    assert sorted(set(bits)) == sorted({sel.low, sel.high})
    assert qm.manifest["linears"]["blk.0.ffn_gate_inp"]["kind"] == "float"
    qm.save(tmp_path / "q")
    again = QuantizedModel.load(tmp_path / "q")
    assert np.array_equal(again.forward(train_ids[:16]), qm.forward(train_ids[:16]))
    with pytest.raises(ValueError, match="not expert linears"):
        quantize(moe, "moe-mixed", expert_bits={"blk.0.attn_q": 2})


def test_moe_mixed_refuses_dense_and_profile_schemes_refuse_moe(smollm, moe):
    from edgeprobe.quant import quantize, schemes_for

    with pytest.raises(UnsupportedModelError, match="dense"):
        quantize(smollm, "moe-mixed")
    with pytest.raises(UnsupportedModelError, match="MoE"):
        quantize(moe, "w8a8-shadow")
    assert "moe-mixed" in schemes_for(moe.config) and "moe-mixed" not in schemes_for(smollm.config)


# ---- expert buffers --------------------------------------------------------------------------------

def test_cache_policies_on_a_known_sequence():
    from edgeprobe_kernels.expert_cache import ExpertCache

    seq = [(0, 0), (0, 1), (0, 0), (0, 2), (0, 0), (0, 1)]
    hits = {}
    for pol in ("fifo", "lru", "lfu"):
        c = ExpertCache(2, pol)
        hits[pol] = [c.access(k, 0) for k in seq]
    # after A B A C: FIFO evicts A (loaded first), LRU and LFU evict B
    assert hits["fifo"] == [False, False, True, False, False, False]
    assert hits["lru"] == [False, False, True, False, True, False]
    assert hits["lfu"] == [False, False, True, False, True, False]
    freq = np.array([[0.9, 0.1], [0.5, 0.5], [0.1, 0.9]])
    c = ExpertCache(2, "edgemoe", freq)
    c.access((2, 0), 0)  # rarely used and far ahead: evicted first
    c.access((1, 0), 0)
    c.access((0, 0), 0, pinned={(0, 0)})
    assert (2, 0) not in c and (1, 0) in c
    c = ExpertCache(1, "lru")
    c.access((0, 0), 0)
    c.access((0, 1), 0, pinned={(0, 0), (0, 1)})  # the only resident expert is in use: not evicted
    assert (0, 0) in c
    with pytest.raises(ValueError, match="policy"):
        ExpertCache(2, "random")
    with pytest.raises(ValueError, match="frequencies"):
        ExpertCache(2, "edgemoe")


def test_cache_simulation_on_real_routing(coact, held_trace):
    from edgeprobe.profile.expert_cache import preload_plan, simulate, sweep

    t = held_trace.slice(0, 512)
    L, E = t.n_layers, t.n_experts
    full = simulate(t, "lru", L * E, coact.a["freq"])
    assert full["demand_reads_per_token"] * t.tokens <= L * E  # only compulsory misses
    oracle = np.asarray(t.experts, np.int64)  # a perfect predictor preloads exactly what is used
    perfect = simulate(t, "lru", 2 * t.k + 2, coact.a["freq"], plan=oracle)
    assert perfect["hit_rate"] > 0.99
    rows = sweep(t, [4, 12, 24], coact.a["freq"], coact.predictor(2), expert_bytes=1000, progress=False)
    assert len(rows) == 4 * 3 * 2
    by = {(r["policy"], r["capacity"], r["preload"]): r for r in rows}
    for pol in ("fifo", "lru", "lfu", "edgemoe"):
        assert by[(pol, 24, False)]["hit_rate"] >= by[(pol, 4, False)]["hit_rate"]
        assert by[(pol, 12, True)]["hit_rate"] > by[(pol, 12, False)]["hit_rate"]
    plan = preload_plan(t, coact.predictor(2), 2)
    assert plan.shape == (t.tokens, L, 2)


def test_profile_experts_cli(tmp_path):
    out = tmp_path / "experts"
    r = subprocess.run([sys.executable, "-m", "edgeprobe", "profile", "experts", "--model", "tiny-moe",
                        "--tokens", "1024", "--window", "128", "--heldout-tokens", "512", "--out", str(out), "--json",
                        "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["tokens"] == 1024 and s["n_experts"] == 8
    assert 0 < s["top20pct_paths_token_share"] <= 1 and s["path_power_law"]["paths_observed"] > 1
    assert set(s["predictor_hit_rate"]) == {"order0", "order1", "order2"}
    assert {r["policy"] for r in s["cache"]["rows"]} == {"fifo", "lru", "lfu", "edgemoe"}
    for f in ("coactivation.npz", "summary.json", "coactivation_paths.html", "coactivation_conditional.html",
              "cache_policies.html", "routing_heldout.npz"):
        assert (out / f).exists(), f
    assert CoActivationStats.load(out / "coactivation.npz").tokens == 1024
