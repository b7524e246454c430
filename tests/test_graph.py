"""The one template: every plan it yields is acyclic and, run in-process by the agent's executor, computes what
`forward()` computes — dense, MoE with and without a shared expert, prefill, chunked prefill under every
scheduler, decode steps and batches, shadow-outlier layouts. Property tests over small random models."""
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgeprobe.forward import KVCache, forward
from edgeprobe.graph import GraphError, Weights, model_ops
from edgeprobe.graph.local import host_session, run_plan
from edgeprobe.models import Model, ModelConfig
from edgeprobe.models.weights import LazyWeights
from edgeprobe.plan import chunked_prefill_plan, prefill_plan, shadow_layers
from edgeprobe.quant import calibration_profile, quantize
from edgeprobe.schedule import DeviceProfile, chunk_graph, schedule
from edgeprobe_agent.executor import validate
from edgeprobe_kernels.names import OP_KINDS

FLOAT_TOL = 1e-3  # the bound for float plans: only summation order differs from forward()


def toy_model(layers=2, hidden=32, heads=4, kv=2, ffn=40, vocab=48, experts=0, k=2, shared=False, gate=False,
              seed=0, gemma=False) -> Model:
    """A random Llama-family model built in code (GGUF tensor names), dense or MoE; gemma: with Gemma 3's
    q/k norms, post norms, GeGLU, scaled embeddings and sliding-window layers (window 3, every 2nd global)."""
    rng = np.random.default_rng(seed)
    d = 8
    cfg = ModelConfig(arch="llama", n_layers=layers, hidden=hidden, ffn=ffn, n_heads=heads, n_kv_heads=kv, head_dim=d,
                      vocab_size=vocab, context_length=256, rope_theta=10000.0, n_experts=experts,
                      n_experts_used=k if experts else 0, expert_ffn=ffn if experts else 0,
                      shared_expert_ffn=24 if shared else 0, shared_expert_gate=gate and shared, name="toy",
                      **(dict(act_fn="gelu_tanh", embed_scale=float(np.sqrt(hidden)), qk_norm=True, post_norms=True,
                              sliding_window=3, swa_pattern=2, rope_theta_local=100.0) if gemma else {}))
    r = lambda *s: rng.normal(size=s) * 0.3
    w = {"token_embd.weight": rng.normal(size=(vocab, hidden)), "output_norm.weight": 1 + 0.1 * rng.normal(size=hidden)}
    for i in range(layers):
        p = f"blk.{i}."
        w.update({p + "attn_norm.weight": 1 + 0.1 * rng.normal(size=hidden), p + "ffn_norm.weight": np.ones(hidden),
                  p + "attn_q.weight": r(heads * d, hidden), p + "attn_k.weight": r(kv * d, hidden),
                  p + "attn_v.weight": r(kv * d, hidden), p + "attn_output.weight": r(hidden, heads * d)})
        if gemma:
            w.update({p + "attn_q_norm.weight": 1 + 0.1 * rng.normal(size=d),
                      p + "attn_k_norm.weight": 1 + 0.1 * rng.normal(size=d),
                      p + "post_attention_norm.weight": 1 + 0.1 * rng.normal(size=hidden),
                      p + "post_ffw_norm.weight": 1 + 0.1 * rng.normal(size=hidden)})
        if experts:
            w.update({p + "ffn_gate_inp.weight": rng.normal(size=(experts, hidden)),
                      p + "ffn_gate_exps.weight": r(experts, ffn, hidden),
                      p + "ffn_up_exps.weight": r(experts, ffn, hidden),
                      p + "ffn_down_exps.weight": r(experts, hidden, ffn)})
            if shared:
                w.update({p + "ffn_gate_shexp.weight": r(24, hidden), p + "ffn_up_shexp.weight": r(24, hidden),
                          p + "ffn_down_shexp.weight": r(hidden, 24)})
                if gate:
                    w[p + "ffn_gate_inp_shexp.weight"] = r(1, hidden)
        else:
            w.update({p + "ffn_gate.weight": r(ffn, hidden), p + "ffn_up.weight": r(ffn, hidden),
                      p + "ffn_down.weight": r(hidden, ffn)})
    loaders = {n: (lambda a=a: np.asarray(a, np.float32)) for n, a in w.items()}
    return Model(config=cfg, tokenizer=None, weights=LazyWeights(loaders, None), source="toy", sha256=f"{seed:064x}",
                 name="toy")


def _logits(outs):
    return next(iter(outs.values()))


def step_after_prompt(qm, step_plan, prompt, token: int = 5):
    """A fresh host session prefilled with `prompt`, then one decode step of `token` under step_plan: (its output,
    its events)."""
    cfg = qm.manifest["config"]
    sess = host_session(cfg, 1, 16)
    run_plan(prefill_plan(qm.manifest, len(prompt), session=True), qm.store.get, {"tokens": prompt}, sess, len(prompt))
    o, events, _ = run_plan(step_plan, qm.store.get, {"tokens": np.array([token], np.int32)}, sess, 1)
    return _logits(o), events


def _check(ours, ref, tol):
    err = float(np.max(np.abs(ours - ref)))
    assert err <= tol, f"max |Δlogit| {err:.2e} > {tol:.0e}"
    return err


def _prof(npu, cpu):
    return DeviceProfile("random", {"npu": {"default": npu}, "cpu": {"default": cpu}}, {"npu": 10.0, "cpu": 5.0})


models = st.fixed_dictionaries({
    "layers": st.integers(1, 2), "heads": st.sampled_from([2, 4]), "kv": st.sampled_from([1, 2]),
    "hidden": st.sampled_from([16, 32]), "ffn": st.sampled_from([24, 40]),
    "moe": st.sampled_from(["dense", "gemma", "moe", "moe+shared", "moe+shared+gate"]), "k": st.integers(1, 2),
    "seed": st.integers(0, 1000)})


def _build(spec) -> Model:
    moe = spec["moe"]
    return toy_model(spec["layers"], spec["hidden"], spec["heads"], spec["kv"], spec["ffn"],
                     experts=4 if moe.startswith("moe") else 0, k=spec["k"], shared="shared" in moe, gate="gate" in moe,
                     seed=spec["seed"], gemma=moe == "gemma")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=models, prompt=st.integers(1, 40), chunk=st.sampled_from([4, 8, 16, 64]),
       scheduler=st.sampled_from(["in-order", "ooo"]), scheme=st.sampled_from(["float", "q4_0"]),
       npu=st.floats(1.0, 1000.0), cpu=st.floats(1.0, 1000.0))
def test_every_plan_runs_to_the_forward_pass_logits(spec, prompt, chunk, scheduler, scheme, npu, cpu):
    m = _build(spec)
    qm = quantize(m, scheme)
    tokens = np.random.default_rng(spec["seed"]).integers(0, m.config.vocab_size, prompt).astype(np.int32)
    ref = qm.forward(tokens, logits="last")  # forward() with this scheme's simulated linears
    tol = FLOAT_TOL if scheme == "float" else 1e-3 * max(1.0, float(np.abs(ref).max()))
    # layer by layer
    outs, events, _ = run_plan(prefill_plan(qm.manifest, prompt), qm.store.get, {"tokens": tokens})
    _check(_logits(outs)[0], ref, tol)
    assert {e["lane"] for e in events} <= {"cpu", "npu"}
    # chunked, laid out by a scheduler
    g = chunk_graph(m.config, prompt, chunk, manifest=qm.manifest)
    sched = schedule(g, _prof(npu, cpu), scheduler)
    sched.check()
    plan = chunked_prefill_plan(qm.manifest, sched)
    validate(plan, has_blob=lambda s: True)  # the agent's cycle check, counting each lane's order
    outs, events, _ = run_plan(plan, qm.store.get, {"tokens": tokens})
    _check(_logits(outs)[0], ref, tol)
    # predicted and measured traces name the same ops
    assert {e["name"] for e in sched.to_trace().events} == {e["name"] for e in events}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=models, prompt=st.integers(1, 12), steps=st.integers(1, 3), batch=st.integers(1, 3))
def test_decode_plans_extend_the_session_like_forward_with_a_cache(spec, prompt, steps, batch):
    m = _build(spec)
    qm = quantize(m, "float")
    rng = np.random.default_rng(spec["seed"])
    tokens = rng.integers(0, m.config.vocab_size, prompt).astype(np.int32)
    cfg = qm.manifest["config"]
    sess = host_session(cfg, 1, prompt + steps)
    outs, _, _ = run_plan(prefill_plan(qm.manifest, prompt, session=True), qm.store.get, {"tokens": tokens}, sess,
                          prompt)
    cache = KVCache(m.config, batch=1)
    _check(_logits(outs)[0], forward(m, tokens, cache=cache, logits="last"), FLOAT_TOL)
    sess.reorder([0] * batch)  # fork the prompt into `batch` sequences, as test-time scaling does
    cache.reorder([0] * batch)
    for _ in range(steps):
        step = rng.integers(0, cfg["vocab_size"], batch).astype(np.int32)
        outs, _, _ = run_plan(prefill_plan(qm.manifest, 1, session=True, batch=batch), qm.store.get, {"tokens": step},
                              sess, 1)
        ref = forward(m, step[:, None], cache=cache, logits="last")
        _check(_logits(outs), ref, FLOAT_TOL)


@pytest.fixture(scope="module")
def shadow_model():
    m = toy_model(layers=3, hidden=32, heads=4, kv=2, ffn=40, seed=7)
    ids = np.random.default_rng(3).integers(0, m.config.vocab_size, 512)
    return m, calibration_profile(m, ids, tokens=512, window=64, progress=False)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(prune=st.sampled_from([0.0, 0.34, 0.67, 1.0]), scheme=st.sampled_from(["w8a8-shadow", "w8a8", "w8a8c-shadow"]),
       prompt=st.integers(1, 48), chunk=st.sampled_from([8, 16, 32]), scheduler=st.sampled_from(["in-order", "ooo"]))
# a rint flip, before FEW_ROWS was pinned
@example(prune=0.0, scheme="w8a8c-shadow", prompt=41, chunk=8, scheduler="in-order")
def test_int8_and_shadow_plans_compute_the_schemes_simulation(shadow_model, prune, scheme, prompt, chunk, scheduler):
    """The plans' structure (int8 and shadow parts, chunks, schedules) against the forward. Chunks of few rows would
    run the numba norm/RoPE/attention kernels, whose last bits differ from numpy's (test_fast_paths compares them):
    enough to flip one int8 activation's rint and move this toy's logits by 0.09. Both sides run numpy here."""
    import edgeprobe_kernels.llama_ops as L

    few, L.FEW_ROWS = L.FEW_ROWS, 0
    try:
        _plans_compute_the_schemes_simulation(shadow_model, prune, scheme, prompt, chunk, scheduler)
    finally:
        L.FEW_ROWS = few


def _plans_compute_the_schemes_simulation(shadow_model, prune, scheme, prompt, chunk, scheduler):
    m, prof = shadow_model
    qm = quantize(m, scheme, prof, prune_rate=prune)
    tokens = np.random.default_rng(prompt).integers(0, m.config.vocab_size, prompt).astype(np.int32)
    ref = qm.forward(tokens, logits="last")
    tol = 1e-3 * max(1.0, float(np.abs(ref).max()))  # int8 activations: a rounding may flip with summation order
    outs, ev, counters = run_plan(prefill_plan(qm.manifest, prompt), qm.store.get, {"tokens": tokens})
    _check(_logits(outs)[0], ref, tol)
    shadowed = shadow_layers(qm.manifest)
    assert any(e["name"].endswith(".shadow") for e in ev) == bool(shadowed)
    sched = schedule(chunk_graph(m.config, prompt, chunk, manifest=qm.manifest), _prof(100.0, 30.0), scheduler)
    assert {s.layer for s in sched.graph.subgraphs if s.stage == "shadow"} == set(shadowed)
    outs, _, _ = run_plan(chunked_prefill_plan(qm.manifest, sched), qm.store.get, {"tokens": tokens})
    _check(_logits(outs)[0], ref, tol)


def test_op_kinds_are_one_table():
    from edgeprobe_agent.ops import OPS

    assert set(OPS) == set(OP_KINDS)  # the agent runs exactly the kinds the template may emit
    m = toy_model(experts=4, shared=True, gate=True)
    ops = model_ops(Weights(m.config), 5, chunk=2)
    assert {op["kind"] for op in ops} <= set(OP_KINDS)
    assert {op["stage"] for op in ops} == {"qkv", "shadow", "attn", "ffn"}


def test_mismatched_schedule_and_bad_phases_are_named():
    m = toy_model()
    qm = quantize(m, "float")
    sched = schedule(chunk_graph(m.config, 8, 4, shadow=True), _prof(10, 10), "ooo")  # a graph with shadow subgraphs
    with pytest.raises(GraphError, match="built for another graph"):
        chunked_prefill_plan(qm.manifest, dataclasses.replace(sched, slots={k: v for k, v in sched.slots.items()
                                                                            if ".l0." not in k}))
    with pytest.raises(GraphError, match="one sequence's prefill"):
        model_ops(Weights(m.config), 8, chunk=4, session=True)
    with pytest.raises(GraphError, match="decode session"):
        prefill_plan(qm.manifest, 4, experts_flash={"capacity": 1})


def test_per_channel_scales_follow_a_heterollm_column_cut(shadow_model):
    """A row cut (HeteroLLM §4.1) hands each lane some output channels: w8a8c-shadow's scales must be cut with them."""
    from edgeprobe_kernels.linear_records import run_w8a8

    m, prof = shadow_model
    qm = quantize(m, "w8a8c-shadow", prof)
    rec = qm.manifest["linears"]["blk.1.ffn_up"]
    x = np.random.default_rng(0).standard_normal((5, rec["shape"][1])).astype(np.float32)
    whole = run_w8a8(rec, qm.store.get, {})(x)
    cut = 17
    parts = [run_w8a8(rec, qm.store.get, {}, cols=c)(x) for c in ((0, cut), (cut, rec["shape"][0]))]
    assert np.array_equal(np.concatenate(parts, axis=1), whole)
