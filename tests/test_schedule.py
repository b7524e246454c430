"""Chunk graphs and schedulers (mllm-NPU §3.2, §3.4) on real model configs, with property tests."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeprobe.models import ModelConfig
from edgeprobe.schedule import CostModel, ScheduleError, chunk_graph, cost_model, schedule

QWEN = ModelConfig(arch="llama", n_layers=24, hidden=2048, ffn=5504, n_heads=16, n_kv_heads=16, head_dim=128,
                   vocab_size=151936, context_length=32768, tie_embeddings=False, name="Qwen1.5-1.8B")
SD = cost_model("snapdragon-8gen3")


def test_chunk_graph_structure_and_dependencies(smollm):
    g = chunk_graph(smollm.config, 600, 256)
    assert g.n_chunks == 3 and len(g.subgraphs) == 3 * 30 * 4
    by = g.by_name()
    # derived from data edges: chunk 2's attention reads its own Q/K/V (int8 + shadow) and the RoPE'd keys that
    # chunks 0 and 1's attention subgraphs wrote; eq. 2 (every earlier chunk's qkv and shadow) follows transitively
    assert set(by["c2.l5.attn"].deps) == {"c2.l5.qkv", "c2.l5.shadow", "c0.l5.attn", "c1.l5.attn"}

    def closure(n, seen=None):
        seen = set() if seen is None else seen
        for d in by[n].deps:
            if d not in seen:
                seen.add(d)
                closure(d, seen)
        return seen
    assert {f"c{k}.l5.{s}" for k in range(3) for s in ("qkv", "shadow")} <= closure("c2.l5.attn")
    assert by["c2.l5.qkv"].deps == ["c2.l4.ffn"] and by["c1.l0.qkv"].deps == []                    # eq. 3
    assert by["c2.l5.attn"].kv_len == 600 and by["c2.l5.attn"].tokens == 88
    assert not by["c0.l0.attn"].static and by["c0.l0.ffn"].static and by["c0.l0.qkv"].lane == "npu"


def test_chunk_shared_graphs_save_memory_in_proportion_to_chunks():
    one = chunk_graph(QWEN, 256, 256).memory()
    four = chunk_graph(QWEN, 1024, 256).memory()
    assert one["saving"] == pytest.approx(0.0, abs=1e-9)  # one chunk: nothing to share
    assert 0.5 < four["saving"] < 0.75  # weights dominate: close to 1 - 1/4 (paper: up to 75%)
    assert four["shared_subgraphs"] == 3 * 24 and four["subgraphs_per_chunk"] == 4 * 24


def test_ooo_beats_in_order_and_times_each_decision():
    g = chunk_graph(QWEN, 1024, 256)
    a, b = schedule(g, SD, "in-order"), schedule(g, SD, "ooo")
    a.check()
    b.check()
    assert b.makespan_us < 0.85 * a.makespan_us
    # every subgraph is one decision, each timed; `edgeprobe schedule` reports how fast (no wall time asserted)
    assert b.decisions >= len(g.subgraphs) and b.decision_us > 0
    t = b.to_trace()
    assert t.meta["modelled"] and all(e["modelled"] for e in t.events)
    assert t.metrics()["makespan_ms"] == pytest.approx(b.makespan_us / 1e3, rel=1e-6)


def test_exact_is_a_lower_bound_on_small_instances(smollm):
    g = chunk_graph(dataclasses.replace(smollm.config, n_layers=1), 768, 256)
    assert len(g.subgraphs) == 12
    opt = schedule(g, SD, "exact")
    opt.check()
    for s in ("in-order", "ooo"):
        assert opt.makespan_us <= schedule(g, SD, s).makespan_us + 1e-6
    with pytest.raises(ScheduleError, match="at most 12"):
        schedule(chunk_graph(smollm.config, 768, 256), SD, "exact")


def test_bad_input_is_named(smollm):
    with pytest.raises(ScheduleError, match="chunk length"):
        chunk_graph(smollm.config, 100, 0)
    with pytest.raises(ScheduleError, match="context length"):
        chunk_graph(smollm.config, smollm.config.context_length + 1, 256)
    with pytest.raises(ScheduleError, match="unknown cost model"):
        cost_model("pixel-42")
    with pytest.raises(ScheduleError, match="unknown scheduler"):
        schedule(chunk_graph(smollm.config, 64, 32), SD, "random")
    with pytest.raises(ScheduleError, match="no lane 'dsp'"):
        schedule(chunk_graph(smollm.config, 64, 32, lanes={"attn": "dsp"}), SD, "ooo")


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 3), prompt=st.integers(1, 700), chunk=st.sampled_from([32, 64, 128, 256]),
       npu=st.floats(1.0, 5000.0), cpu=st.floats(1.0, 500.0), sync=st.floats(0.0, 500.0),
       attn_lane=st.sampled_from(["cpu", "gpu"]))
def test_every_schedule_respects_dependencies_and_lanes(layers, prompt, chunk, npu, cpu, sync, attn_lane):
    cfg = ModelConfig(arch="llama", n_layers=layers, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=100, context_length=1024)
    prof = CostModel("random", {"npu": {"default": npu}, "cpu": {"default": cpu}, "gpu": {"default": cpu * 3}},
                         {"npu": 10.0, "cpu": 5.0, "gpu": 8.0}, sync_us=sync)
    g = chunk_graph(cfg, prompt, chunk, lanes={"attn": attn_lane})
    results = {s: schedule(g, prof, s) for s in ("in-order", "ooo")}
    for sc in results.values():
        sc.check()
        assert set(sc.slots) == {x.name for x in g.subgraphs}
    if len(g.subgraphs) <= 8:
        opt = schedule(g, prof, "exact")
        opt.check()
        assert opt.makespan_us <= min(r.makespan_us for r in results.values()) + 1e-6


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(1, 3), prompt=st.integers(1, 300), chunk=st.sampled_from([16, 32, 64]),
       npu=st.floats(1.0, 5000.0), cpu=st.floats(1.0, 500.0), shadow=st.sampled_from([True, False, (0,)]),
       scheduler=st.sampled_from(["in-order", "ooo"]))
def test_every_scheduled_plan_is_deadlock_free_on_the_agent(layers, prompt, chunk, npu, cpu, shadow, scheduler):
    """The agent runs each lane's ops in the schedule's order; a data edge the graph does not know (e.g. a shadow
    subgraph reading the qkv subgraph's embedding) would close a cycle with that order. The agent's own check."""
    from edgeprobe.plan import chunked_prefill_plan
    from edgeprobe_agent.executor import validate

    cfg = ModelConfig(arch="llama", n_layers=layers, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=100, context_length=1024)
    shadowed = set(range(layers)) if shadow is True else set() if shadow is False else set(shadow) & set(range(layers))
    lin = {f"blk.{l}.{p}": ({"kind": "w8a8-shadow", "shadow": {"rows": "x"}} if l in shadowed and p.startswith("attn_")
                            and p != "attn_output" else {"kind": "w8a8"})
           for l in range(layers)
           for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    tensors = {n: f"{i:064x}" for i, n in enumerate(["token_embd.weight", "output_norm.weight"] + [
        f"blk.{l}.{t}.weight" for l in range(layers) for t in ("attn_norm", "ffn_norm")])}
    manifest = {"config": dataclasses.asdict(cfg), "tensors": tensors, "linears": lin}
    prof = CostModel("random", {"npu": {"default": npu}, "cpu": {"default": cpu}}, {"npu": 10.0, "cpu": 5.0})
    sched = schedule(chunk_graph(cfg, prompt, chunk, shadow=sorted(shadowed)), prof, scheduler)
    validate(chunked_prefill_plan(manifest, sched), has_blob=lambda s: True)  # raises PlanError on a cycle


def test_schedule_cli(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "edgeprobe", "schedule", "--prompt-len", "600", "--chunk", "256",
                        "--scheduler", "ooo", "--out", str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    from edgeprobe import models
    from edgeprobe.plan import shadow_layers
    from edgeprobe.prepare import prepared

    # the w8a8-shadow model it schedules (the cache's, as run's): qkv, attn, ffn per chunk and layer, and a shadow
    # GEMM in each layer whose outliers the pruning kept
    kept = shadow_layers(prepared(models.load("smollm2-135m"), "w8a8-shadow").manifest)
    assert 0 < len(kept) < 30 and d["scheme"] == "w8a8-shadow"
    assert d["modelled"] and d["subgraphs"] == 3 * (30 * 3 + len(kept)) and 0 < d["makespan_vs_in_order"] <= 1.0
    assert 0 < d["memory"]["saving"] < 1 and d["decision_us"] > 0
    doc = json.loads(out.read_text())
    assert len(doc["slots"]) == d["subgraphs"] and "c2.l0.attn" in doc["deps"]
    assert d["cost_model"] == d["device_profile"] == "snapdragon-8gen3"  # the new field beside the old one
    bad = subprocess.run([sys.executable, "-m", "edgeprobe", "schedule", "--prompt-len", "600", "--cost-model", "x"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown cost model 'x'" in bad.stderr


def test_device_profile_is_the_cost_models_old_name():
    """Command lines and code written with the old word keep working: --device-profile sets what --cost-model sets,
    and the old class and function names are the new ones."""
    from edgeprobe import schedule as sch
    from edgeprobe.cli import build_parser
    from edgeprobe.schedule import cost, hetero, measure

    for cmd in (["schedule", "--prompt-len", "8"], ["run"]):
        old = build_parser().parse_args([*cmd, "--device-profile", "measured-real"])
        new = build_parser().parse_args([*cmd, "--cost-model", "measured-real"])
        assert vars(old) == vars(new) and new.cost_model == "measured-real"
        sub = build_parser()._subparsers._group_actions[0].choices[cmd[0]]
        flag = next(a for a in sub._actions if a.dest == "cost_model")
        assert flag.option_strings == ["--cost-model", "--device-profile"]
    assert (sch.DeviceProfile, sch.MeasuredProfile, sch.HeteroProfile) == (cost.CostModel, measure.MeasuredCostModel,
                                                                           hetero.HeteroCostModel)
    assert (sch.device_profile, sch.measure_profile) == (sch.cost_model, sch.measure_cost_model)
    assert sch.PROFILES is sch.COST_MODELS and sch.HETERO_PROFILES is sch.HETERO_COST_MODELS
    sched = schedule(chunk_graph(QWEN, 64, 32), SD, "in-order")
    assert sched.profile is sched.cost_model is SD
    meta = sched.to_trace().meta
    assert meta["cost_model"] == meta["profile"] == "snapdragon-8gen3"


def test_heterollm_solver_beats_padding_and_pipe_at_unaligned_lengths(smollm):
    from edgeprobe.schedule.hetero import (
        ROW_ALIGN,
        SEQ_ALIGN,
        candidates,
        compare_strategies,
        pad_to_prebuilt,
        pipe_parts,
        solve,
    )
    from edgeprobe.schedule.hetero import SNAPDRAGON_HETERO as P

    assert pad_to_prebuilt(P, 300) == 512 and pad_to_prebuilt(P, 256) == 256 and pad_to_prebuilt(P, 2100) == 3072
    assert pipe_parts(P, 300) == (256, 32, 32) and pipe_parts(P, 525) == (512, 32)
    for m, k, n in [(300, 576, 1536), (525, 2048, 5504), (1000, 1536, 576), (7, 64, 64)]:
        cands = candidates(P, m, k, n)
        best = solve(P, m, k, n)
        assert all(best.time_us <= c.time_us for c in cands)
        for c in cands:
            if c.strategy == "seq-cut":
                assert c.npu_rows % SEQ_ALIGN == 0 and 0 < c.npu_rows <= m and sum(c.npu_parts) == c.npu_rows
            if c.strategy == "row-cut":
                assert c.npu_cols % ROW_ALIGN == 0 and 0 < c.npu_cols < n
    for m in (300, 525, 1000):
        r = compare_strategies(QWEN, m)
        t = r["total_ms"]
        assert t["solver"] <= min(t["npu-pad"], t["pipe"], t["gpu"]) + 1e-9
        assert r["speedup_vs_padding"] > 1.2 and r["modelled"]
    aligned = compare_strategies(smollm.config, 256)
    # no padding to save at an aligned length: what the solver gains there is the GPU's share of each row cut
    # (HeteroLLM's hetero-tensor over hetero-layer), bought with one fast sync per matmul
    assert aligned["speedup_vs_padding"] >= 1.0
    assert {c["strategy"] for c in aligned["choices"].values()} <= {"row-cut", "npu-pad"}
    no_sync_gain = compare_strategies(smollm.config, 256, dataclasses.replace(P, gpu_gflops=1e-3))
    assert no_sync_gain["speedup_vs_padding"] == pytest.approx(1.0)  # no GPU worth a share: nothing to gain
    with pytest.raises(ScheduleError, match="positive"):
        solve(P, 0, 64, 64)
    # two processors that slow each other down (shared cores or bandwidth) make a split lose: the solver stops cutting
    shared = dataclasses.replace(P, slowdown_npu=3.0, slowdown_gpu=3.0)
    for m in (300, 525, 1000):
        picked = {c["strategy"] for c in compare_strategies(QWEN, m, shared)["choices"].values()}
        assert picked <= {"gpu", "npu-pad", "pipe"}
    assert "row-cut" in {c["strategy"] for c in compare_strategies(QWEN, 1000)["choices"].values()}


def test_this_host_prices_elementwise_ops_and_the_shadow_work_the_prune_rate_keeps():
    """Issue 19: at prune rate 0 the modelled makespan was half the measured one; elementwise ops were priced at a
    GEMM rate (a 64x1536 SwiGLU at 1.4 µs, measured ~0.4 ms) and the shadow GEMMs of every kept layer at FLOPs alone."""
    from edgeprobe import models
    from edgeprobe.schedule import chunk_graph, cost_model, schedule

    cfg = models.load("smollm2-135m").config
    prof = cost_model("this-host-emulated")
    every = chunk_graph(cfg, 256, 64, shadow=True)  # prune rate 0: every layer keeps its outliers
    few = chunk_graph(cfg, 256, 64, shadow={0, 1, 2, 11, 28})  # 0.85: five layers keep them
    swiglu = next(o for o in every.ops if o["kind"] == "swiglu")
    assert 100 <= prof.op_time_us(swiglu, "npu") <= 1000
    n_shadow = sum(1 for o in every.ops if ".shadow" in o["name"]) - sum(1 for o in few.ops if ".shadow" in o["name"])
    t_every, t_few = (schedule(g, prof, "ooo").makespan_us for g in (every, few))
    # the extra shadow work of 25 more layers shows in the prediction: at least its per-op cost, spread on two lanes
    assert t_every - t_few >= n_shadow * prof.op_us["cpu"] / 2 and t_every > 1.05 * t_few


def test_a_measured_cost_model_is_not_moved_by_a_few_preempted_ops():
    from edgeprobe.schedule.measure import MeasuredCostModel

    # 15 samples a shape at 3 shapes on t = 20 us + 1 us / kFLOP, and three ops stalled 3-4 ms (a CI machine's
    # preemption, as in a failed notebook run): least squares through the means predicted 2-5x the typical time
    true = lambda f: 20 + f / 1000
    samples = [{"lane": "cpu", "stage": "shadow", "tokens": c, "kv_len": 0, "flops": 16000 * c, "chunk": c,
                "us": true(16000 * c) * (1 + 0.05 * ((i % 5) - 2))} for c in (4, 8, 16) for i in range(15)]
    for s, stall in zip([s for s in samples if s["chunk"] == 16][0:5:2], (3500, 3900, 4100)):  # medians move a rank
        s["us"] = stall
    prof = MeasuredCostModel(samples)
    a, b = prof.fits["cpu/shadow"]
    assert a == pytest.approx(20, abs=10) and b == pytest.approx(1e-3, rel=0.1)  # least squares: a = 0, b 3.2x
    assert prof.fit_error()["cpu/shadow"]["median"] < 0.1
