"""Numerics op by op on real agents (issue 41), SmolLM2 under w8a8: on the local agent a 16-token prefill with every op
captured, compared with the host's simulation and the float model, a seeded one-code fault found by name; on the agents
that run other machine code (the emulated arm64 agent: numpy kernels under qemu-aarch64, as tests/e2e/test_arm64.py
starts it; the hvx agent: its npu lane's Hexagon code under qemu-hexagon) an 8-token prefill (the emulation is slow);
and a plan that splits linears (w8a8c-shadow, local agent).

Measured here: the hvx agent's every op equals the host's simulation bit for bit (int8 GEMMs exact, the cpu lane is
the host's own numba). On arm64 the npu lane's int8 linears are exact given their inputs, while the float32 parts
(norms, swiglu, the head) round in their last bits against x86's: max device-vs-simulation relative L2 3.7e-7
(lm_head), max |diff| 2.3e-5. A one-code fault reads ~5e-4 to 2e-3 at its op.
"""
import numpy as np
import pytest

from edgeprobe.device import Device, DeviceError
from edgeprobe.numerics import NumericsError, prefill_numerics
from edgeprobe.plan import prefill_plan

ARM64_FLOAT_REL_L2 = 2e-6   # arm64 vs x86 float32 rounding, per op (measured 3.7e-7): far under one code (~5e-4)
FAULT_OPS = "blk.1.*,blk.2.*"


@pytest.fixture(scope="module")
def qm(smollm):
    from edgeprobe.prepare import prepared

    return prepared(smollm, "w8a8", progress=False)


@pytest.fixture(scope="module")
def tokens(heldout_ids):
    return np.asarray(heldout_ids[:16], np.int32)


@pytest.fixture(scope="module")
def tokens8(heldout_ids):
    return np.asarray(heldout_ids[:8], np.int32)


@pytest.fixture(scope="module")
def agent(module_dir):
    d = Device.local(store=module_dir / "numerics-store")
    yield d
    d.close()


def test_every_op_captured_matches_the_simulation_and_shows_the_price_of_w8a8(agent, qm, tokens, smollm, tmp_path):
    res = prefill_numerics(agent, qm, tokens, float_model=smollm)
    rep = res.numerics
    names = [e["name"] for e in res.trace.events if e["kind"] != "numerics" and e["lane"] != "io"]
    assert len(rep.ops) == len(names) == rep.meta["ops_captured"] == rep.meta["full_captured"]
    assert {r["op"] for r in rep.ops} == set(names) and rep.first_divergent is None
    # the local agent's numba kernels compute what the simulation says, to float32's last bits
    assert max(r["device_vs_sim"]["rel_l2"] for r in rep.ops) < 1e-6
    assert all(r["device_vs_sim"]["method"] == "full" for r in rep.ops)
    by = rep.by_name()
    assert by["blk.0.attn_norm"]["scheme_vs_float"]["rel_l2"] == 0  # before the first quantized linear: exact
    assert 1e-3 < by["blk.0.attn_q"]["scheme_vs_float"]["rel_l2"] < 0.2
    assert by["lm_head"]["shape"] == [1, smollm.config.vocab_size]
    # each capture is an event of its own on its op's lane, after the op
    ops = {e["name"]: e for e in res.trace.events}
    caps = [e for e in res.trace.events if e["kind"] == "numerics"]
    assert len(caps) == len(names)
    assert all(e["lane"] == ops[e["deps"][0]]["lane"] and e["start_us"] >= ops[e["deps"][0]]["end_us"] for e in caps)
    assert np.allclose(res.logits, qm.forward(tokens, logits="last")[None], rtol=0, atol=1e-4)
    paths = rep.write(tmp_path)
    import json
    saved = json.loads(open(paths["json"]).read())
    assert saved["first_divergent"] is None and len(saved["ops"]) == len(names)
    assert "plotly" in open(paths["html"]).read()[:100000].lower()


def test_a_one_code_fault_in_one_op_is_the_first_divergent_op_by_name(agent, qm, tokens):
    fault = {"op": "blk.3.attn_output", "index": 5, "codes": 1}
    rep = prefill_numerics(agent, qm, tokens, ops="blk.2.*,blk.3.*,blk.4.*", fault=fault).numerics
    assert rep.first_divergent["op"] == "blk.3.attn_output", rep.first_divergent
    by = rep.by_name()
    assert by["blk.3.attn_output"]["device_vs_sim"]["max_abs"] == pytest.approx(
        by["blk.3.attn_output"]["sim"]["max_abs"] / 127, rel=1e-3)
    assert all(by[n]["device_vs_sim"]["rel_l2"] == 0 for n in by if n.startswith("blk.2."))
    assert by["blk.4.attention"]["device_vs_sim"]["rel_l2"] > 0  # it flows on


def test_bad_captures_are_refused_naming_the_pattern_the_size_or_the_version(agent, qm, tokens, monkeypatch):
    with pytest.raises(NumericsError, match=r"'blk\.99\.\*' names no op"):
        prefill_numerics(agent, qm, tokens, ops="blk.99.*")
    with pytest.raises(NumericsError, match=r"is 3145728 bytes \(3\.0 MiB\), over the limit of 1000000 bytes"):
        prefill_numerics(agent, qm, tokens, ops="lm_head", full=["lm_head"] * 16, limit_bytes=1_000_000)
    # the agent refuses on its own too: a pattern naming nothing, a full capture past the request's limit
    from edgeprobe.plan import prefill_plan

    plan_id = agent.put_plan(prefill_plan(qm.manifest, len(tokens)))
    with pytest.raises(DeviceError, match=r"'nope\*' names no op of the plan") as e:
        agent.request("run", [tokens], plan_id=plan_id, inputs=["tokens"], numerics={"ops": "nope*"})
    assert e.value.code == "bad_request"
    with pytest.raises(DeviceError, match=r"196608 bytes, over the limit of 1000 bytes") as e:
        agent.request("run", [tokens], plan_id=plan_id, inputs=["tokens"],
                      numerics={"ops": "lm_head", "full": ["lm_head"], "full_limit_bytes": 1000})
    assert e.value.code == "memory_budget"
    # an agent that predates capture ignores the field: its reply has no numerics
    real = agent.request

    def old_agent(op, *a, **k):
        k.pop("numerics", None)
        head, arrays = real(op, *a, **k)
        head.pop("numerics", None)
        return head, arrays

    monkeypatch.setattr(agent, "request", old_agent)
    with pytest.raises(NumericsError, match=r"the agent \(version 0\.\d+\.\d+\) does not capture numerics"):
        prefill_numerics(agent, qm, tokens, ops="lm_head")


def test_run_cli_writes_numerics_and_refuses_a_pattern_naming_nothing(tmp_path):
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "edgeprobe", "run", "--model", "smollm2-135m", "--scheme", "w8a8", "--prompt-len",
            "16", "--no-progress", "--store", str(tmp_path / "store")]
    r = subprocess.run(base + ["--numerics", "--numerics-ops", "blk.99.*"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "edgeprobe: error: --numerics-ops 'blk.99.*' names no op of the plan (ops are named like 'embed', "
        "'blk.1.attn_q', 'blk.1.*', 'lm_head')")
    r = subprocess.run(base + ["--numerics", "--numerics-max-tolerance", "0"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "edgeprobe: error: --numerics-max-tolerance must be a positive relative error, got 0.0")
    r = subprocess.run(base + ["--numerics", "--numerics-ops", "blk.0.*,lm_head", "--numerics-out", str(tmp_path / "n"),
                               "--numerics-max-tolerance", "3e-5", "--json"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    nm = json.loads(r.stdout.strip().splitlines()[-1])["numerics"]
    assert nm["ops"] == 16 and nm["first_divergent"] is None and nm["capture_ms"] > 0
    assert (nm["tolerance"], nm["max_tolerance"]) == (1e-4, 3e-5)  # the scheme's L2 default, the max_rel asked for
    saved = json.loads((tmp_path / "n" / "numerics.json").read_text())
    assert [o["op"] for o in saved["ops"]][-1] == "lm_head" and (tmp_path / "n" / "numerics.html").stat().st_size


# ---- the arm64 and hvx agents, a split linear -------------------------------------------------------
@pytest.fixture(scope="module")
def plan_ops(qm, tokens8):
    """{op name: plan op} of the 8-token prefill, in plan order."""
    return {o["name"]: o for o in prefill_plan(qm.manifest, len(tokens8))["ops"]}


@pytest.fixture(scope="module")
def arm64_agent(module_dir):
    d = Device.local(store=module_dir / "arm64-numerics", arch="arm64")
    yield d
    d.close()


@pytest.fixture(scope="module")
def hvx_agent(module_dir, hvx_toolchain):
    d = Device.local(store=module_dir / "hvx-numerics", npu_backend="hvx", lanes=["cpu", "npu"])
    yield d
    d.close()


def _captured_as_asked(res, names):
    """Every asked op has one summary and one numerics:<op> event on its op's lane."""
    rep = res.numerics
    assert [r["op"] for r in rep.ops] == list(names) and rep.meta["ops_captured"] == len(names)
    ops = {e["name"]: e for e in res.trace.events if e["kind"] != "numerics"}
    caps = [e for e in res.trace.events if e["kind"] == "numerics"]
    assert sorted(e["deps"][0] for e in caps) == sorted(names)
    assert all(e["lane"] == ops[e["deps"][0]]["lane"] for e in caps)
    return ops


def _fault_is_first(agent, qm, tokens8, plan_ops, op):
    """A one-code fault at `op` (one int8 step at its per-tensor scale): it, by name, is the first divergent op."""
    rep = prefill_numerics(agent, qm, tokens8, ops=FAULT_OPS, fault={"op": op, "index": 3, "codes": 1}).numerics
    assert rep.first_divergent["op"] == op, rep.first_divergent
    by = rep.by_name()
    assert by[op]["device_vs_sim"]["max_abs"] == pytest.approx(by[op]["device"]["max_abs"] / 127, rel=1e-2)
    return rep


def test_arm64_captures_every_op_int8_linears_exact_float_parts_to_rounding(arm64_agent, qm, tokens8, plan_ops):
    assert arm64_agent.info["machine"] == "aarch64" and arm64_agent.info["backends"]["npu"]["kernels"] == "numpy"
    res = prefill_numerics(arm64_agent, qm, tokens8)
    rep = res.numerics
    ops = _captured_as_asked(res, [n for n, o in plan_ops.items() if o["lane"] != "io"])
    assert rep.meta["full_captured"] == len(rep.ops)
    assert all(ops[r["op"]]["backend"] == "numpy" for r in rep.ops)
    # float32 rounding alone up to the first divergence, if any; and a divergence may only be an int8 linear whose
    # input left the simulation by rounding alone: one activation code rounded the other way (whether one does
    # depends on the host CPU's float bits: none on a Zen 5 host, one at blk.23.ffn_gate on a Zen 4)
    div = rep.first_divergent
    upto = rep.ops if div is None else rep.ops[:rep.ops.index(rep.by_name()[div["op"]])]
    worst = max(upto, key=lambda r: r["device_vs_sim"]["rel_l2"])
    assert worst["device_vs_sim"]["rel_l2"] < ARM64_FLOAT_REL_L2, worst
    if div is not None:
        assert plan_ops[div["op"]]["lane"] == "npu", div
        source = plan_ops[div["op"]]["inputs"][0]["op"]
        assert rep.by_name()[source]["device_vs_sim"]["rel_l2"] < ARM64_FLOAT_REL_L2, (div, source)
    # each npu-lane int8 linear, run by the host's simulation on the device's own input, gives the device's output
    # bit for bit: whatever differs there came in through the float32 parts upstream
    linears = [n for n, o in plan_ops.items() if o["lane"] == "npu"]
    assert len(linears) == 7 * qm.model.config.n_layers
    for n in linears:
        x = rep.device_full[plan_ops[n]["inputs"][0]["op"]]
        assert np.array_equal(qm.linear(n, x), rep.device_full[n]), n


def test_arm64_names_a_seeded_fault_in_a_cpu_lane_op_and_in_an_npu_lane_linear(arm64_agent, qm, tokens8, plan_ops):
    assert plan_ops["blk.1.ffn_norm"]["lane"] == "cpu" and plan_ops["blk.1.ffn_up"]["lane"] == "npu"
    _fault_is_first(arm64_agent, qm, tokens8, plan_ops, "blk.1.ffn_norm")
    # numpy's int8 GEMMs hand back a transposed array: the fault must land in it all the same
    _fault_is_first(arm64_agent, qm, tokens8, plan_ops, "blk.1.ffn_up")


def test_hvx_captures_every_op_equal_to_the_simulation_and_names_a_fault_in_hexagon_code(hvx_agent, qm, tokens8,
                                                                                         plan_ops):
    assert hvx_agent.info["backends"]["npu"]["chosen"] == "hvx"
    res = prefill_numerics(hvx_agent, qm, tokens8)
    rep = res.numerics
    ops = _captured_as_asked(res, [n for n, o in plan_ops.items() if o["lane"] != "io"])
    assert rep.meta["full_captured"] == len(rep.ops) and rep.first_divergent is None
    npu = [n for n, o in plan_ops.items() if o["lane"] == "npu"]
    assert npu and all(ops[n]["emulated"] == "isa" and ops[n]["backend"] == "hvx" for n in npu)
    # the int8 path is exact on Hexagon code, the cpu lane is the host's own kernels: every op bit for bit
    assert all(r["device_vs_sim"]["max_abs"] == 0 and r["device_vs_sim"]["method"] == "full" for r in rep.ops)
    rep = _fault_is_first(hvx_agent, qm, tokens8, plan_ops, "blk.1.ffn_up")
    assert all(r["device_vs_sim"]["max_abs"] == 0 for r in rep.ops[:rep.ops.index(rep.by_name()["blk.1.ffn_up"])])


def test_a_split_linear_is_compared_at_its_join_under_the_linear_s_name(dev, smollm, tokens8):
    """w8a8c-shadow splits each linear into an int8 part (npu), a shadow part (cpu) and their join, "<linear>.sum":
    the join is the host's linear, compared under its name (the local agent: exact)."""
    from edgeprobe.prepare import prepared

    qm = prepared(smollm, "w8a8c-shadow", progress=False)
    names = [o["name"] for o in prefill_plan(qm.manifest, len(tokens8))["ops"]]
    assert "blk.0.attn_q.sum" in names and "blk.0.attn_q" not in names
    rep = prefill_numerics(dev, qm, tokens8).numerics
    by = rep.by_name()
    linears = [n for n in by if n.startswith("blk.") and n.split(".")[2] in ("attn_q", "ffn_up", "ffn_down")]
    assert len(linears) == 3 * qm.model.config.n_layers and "blk.0.attn_q.sum" not in by
    assert rep.first_divergent is None and all(r["device_vs_sim"]["max_abs"] == 0 for r in rep.ops)
    rep = prefill_numerics(dev, qm, tokens8, ops="blk.1.*", fault={"op": "blk.1.attn_q.sum", "index": 3}).numerics
    assert rep.first_divergent["op"] == "blk.1.attn_q"


# ---- decode steps ---------------------------------------------------------------------------------------------
def test_decode_steps_capture_every_op_of_each_step_against_references_through_the_kv_cache(agent, qm, tokens8,
                                                                                             smollm, tmp_path):
    import json

    from edgeprobe.forward import KVCache, forward
    from edgeprobe.numerics import decode_numerics, op_names, plan_op_names

    res = decode_numerics(agent, qm, tokens8, steps=3, float_model=smollm)
    dn = res.numerics
    step_names = op_names(smollm.config, 1, session=True)
    # a decode step is one fused op on the agent; its sub-ops are the template's ops, named as the host names them
    assert plan_op_names(prefill_plan(qm.manifest, 1, session=True)) == step_names
    assert dn.prefill is not None and [r["op"] for r in dn.prefill.ops] == op_names(smollm.config, 8, session=True)
    assert [r.meta["step"] for r in dn.steps] == [0, 1, 2] and [r.meta["position"] for r in dn.steps] == [8, 9, 10]
    assert all([r["op"] for r in rep.ops] == step_names for rep in dn.steps)
    assert all(r["device_vs_sim"]["method"] == "full" for rep in dn.steps for r in rep.ops)
    assert dn.first_divergent is None
    worst = max((r for rep in [dn.prefill] + dn.steps for r in rep.ops), key=lambda r: r["device_vs_sim"]["rel_l2"])
    assert worst["device_vs_sim"]["rel_l2"] < 1e-6, worst
    # greedy on the agent: step 0 fed the prefill's argmax, each later step the last step's
    logits = res.outputs["logits"]
    assert logits.shape == (3, 1, smollm.config.vocab_size)
    assert dn.tokens[1:].tolist() == [int(np.argmax(lg)) for lg in logits[:2]]
    # the captured lm_head of each step is the logits the step returned
    for k, rep in enumerate(dn.steps):
        assert np.array_equal(rep.device_full["lm_head"], logits[k])
    # the simulation's references are the quantized model's KV-cache decode, at the same positions
    cache = KVCache(smollm.config)
    forward(qm.model, tokens8, cache=cache, linear=qm.linear, logits="none")
    for k, rep in enumerate(dn.steps):
        ref = forward(qm.model, dn.tokens[k:k + 1], cache=cache, linear=qm.linear, logits="last")
        assert rep.by_name()["lm_head"]["sim"]["l2"] == pytest.approx(np.linalg.norm(ref.astype(np.float64)),
                                                                       rel=1e-12)
    by = dn.steps[0].by_name()
    assert by["blk.0.attn_norm"]["scheme_vs_float"]["rel_l2"] == 0  # before the first quantized linear: exact
    assert 1e-3 < by["blk.0.attn_q"]["scheme_vs_float"]["rel_l2"] < 0.2
    # each step's captures are events of their own, tagged with the step: after the event of the op they take (embed,
    # output_norm, lm_head), or inside the event of the fused layer whose sub-op they take (blk.{i}.attn_q)
    caps = [e for e in res.trace.events if e["kind"] == "numerics" and "step" in e]
    assert sorted(e["step"] for e in caps) == sorted([0, 1, 2] * len(step_names))
    subs = {(e.get("step"), e["name"]): e for e in res.trace.events if e["kind"] != "numerics"}
    for e in caps:
        op = subs.get((e["step"], e["deps"][0]))
        if op is not None:
            assert e["lane"] == op["lane"] and e["start_us"] >= op["end_us"], e
        else:
            layer = subs[(e["step"], f"blk.{e['layer']}")]
            assert e["lane"] == layer["lane"] and layer["start_us"] <= e["start_us"] <= e["end_us"] <= \
                layer["end_us"], e
    saved = dn.to_json()
    assert saved["first_divergent"] is None and saved["decode_steps"] == 3 and saved["tokens"] == dn.tokens.tolist()
    assert len(saved["steps"]) == 3 and saved["steps"][1]["step"] == 1 and saved["prefill"]["phase"] == "prefill"
    paths = dn.write(tmp_path)
    assert json.loads(open(paths["json"]).read())["format"] == "edgeprobe-numerics-decode/1"
    assert "plotly" in open(paths["html"]).read()[:100000].lower()


def test_a_one_code_fault_in_a_decode_step_is_named_with_its_step(agent, qm, tokens8):
    from edgeprobe.numerics import decode_numerics

    fault = {"op": "blk.1.attn_output", "index": 5, "codes": 1, "step": 1}
    dn = decode_numerics(agent, qm, tokens8, steps=3, ops="blk.1.*,blk.2.*", fault=fault).numerics
    first = dn.first_divergent
    assert (first["op"], first["phase"], first["step"]) == ("blk.1.attn_output", "decode", 1), first
    assert dn.prefill.first_divergent is None and dn.steps[0].first_divergent is None
    by = dn.steps[1].by_name()
    assert by["blk.1.attn_output"]["device_vs_sim"]["max_abs"] == pytest.approx(
        by["blk.1.attn_output"]["device"]["max_abs"] / 127, rel=1e-2)
    assert by["blk.2.attn_norm"]["device_vs_sim"]["rel_l2"] > 0  # it flows on through the step ...
    # ... and into the next step through the KV cache: blk.2's keys and values at step 1's position moved, so step 2
    # leaves the simulation first where it reads them (blk.1's were written before the fault)
    assert dn.steps[2].first_divergent["op"] == "blk.2.attention", dn.steps[2].first_divergent
    # given tokens, one run a step: the same fault at step 0 is named there
    fault0 = {"op": "blk.2.ffn_up", "index": 3, "codes": 1, "step": 0}
    dn = decode_numerics(agent, qm, tokens8, steps=2, step_tokens=[17, 42], ops="blk.2.*", fault=fault0,
                         prefill=False).numerics
    assert dn.prefill is None and dn.tokens.tolist() == [17, 42]
    assert (dn.first_divergent["op"], dn.first_divergent["step"]) == ("blk.2.ffn_up", 0)


def test_decode_capture_refuses_a_pattern_naming_nothing_and_an_agent_without_it(agent, qm, tokens8, monkeypatch):
    from edgeprobe.numerics import decode_numerics

    with pytest.raises(NumericsError, match=r"'blk\.99\.\*' names no op of a decode step"):
        decode_numerics(agent, qm, tokens8, ops="blk.99.*")
    monkeypatch.delitem(agent.info, "numerics")  # what an agent that predates decode-step capture says in hello
    with pytest.raises(NumericsError, match=r"the agent \(version 0\.\d+\.\d+, numerics capture 1\) does not capture "
                                            r"numerics inside decode steps \(capture 2 does\); update the agent"):
        decode_numerics(agent, qm, tokens8, ops="lm_head")


def test_a_shadow_scheme_s_decode_step_is_compared_at_the_host_s_ops_and_names_a_fault_there(dev, smollm, tokens8):
    """w8a8c-shadow's decode step keeps each linear whole on the cpu lane (its prefill splits them at "<linear>.sum")
    and adds device-only shadow ops (blk.{i}.shadow_norm), captured but with no host op to compare with."""
    from edgeprobe.numerics import decode_numerics, op_names, plan_op_names
    from edgeprobe.prepare import prepared

    qm = prepared(smollm, "w8a8c-shadow", progress=False)
    names = plan_op_names(prefill_plan(qm.manifest, 1, session=True))
    assert "blk.1.shadow_norm" in names and "blk.1.attn_q" in names and "blk.1.attn_q.sum" not in names
    dn = decode_numerics(dev, qm, tokens8, steps=2, ops="blk.1.*", fault={"op": "blk.1.attn_q", "index": 3,
                                                                           "step": 1}).numerics
    assert [r["op"] for r in dn.steps[0].ops] == [n for n in op_names(smollm.config, 1, True) if n.startswith("blk.1.")]
    assert all(r["device_vs_sim"]["max_abs"] == 0 for r in dn.steps[0].ops)
    assert (dn.first_divergent["op"], dn.first_divergent["step"]) == ("blk.1.attn_q", 1)
    # a fault at an op the step does not have is refused, not silently never applied
    with pytest.raises(DeviceError, match=r"fault op 'blk\.1\.attn_q\.sum' is not an op of the plan"):
        decode_numerics(dev, qm, tokens8, steps=1, ops="blk.1.*", fault={"op": "blk.1.attn_q.sum", "step": 0})


# ---- a chunked prefill, a HeteroLLM split, the ssh agent, the command line --------------------------------------
@pytest.fixture(scope="module")
def tokens40(heldout_ids):
    return np.asarray(heldout_ids[:40], np.int32)


def test_a_chunked_prefill_is_compared_chunk_by_chunk_through_the_host_s_kv_cache(agent, qm, tokens40, smollm):
    """mllm-NPU §3.2's chunked prefill, out of order: chunks of 16, 16 and 8 tokens, each chunk's ops (c{i}.l{l}.X)
    against the host's blk.{l}.X of the same chunk, fed through a KV cache as the agent's chunks attend."""
    from edgeprobe.workflows import host_logits

    res = agent.prefill_chunked(qm, tokens40, chunk=16, scheduler="ooo", progress=False,
                                numerics={"float_model": smollm})
    rep = res.numerics
    names = [e["name"] for e in res.trace.events if e["kind"] != "numerics" and e["lane"] != "io"]
    assert {r["op"] for r in rep.ops} == set(names) and rep.first_divergent is None
    assert (rep.meta["chunk"], rep.meta["chunks"], rep.meta["plan"]) == (16, 3, "chunked-prefill")
    assert [r["chunk"] for r in rep.ops] == sorted(r["chunk"] for r in rep.ops)  # chunk by chunk
    by = rep.by_name()
    assert by["c1.l3.attn_q"]["host_op"] == "blk.3.attn_q" and by["c1.l3.attn_q"]["shape"] == [16, 576]
    assert by["c2.l3.attn_q"]["shape"] == [8, 576] and by["c2.l3.attn_q"]["layer"] == 3
    assert max(r["device_vs_sim"]["rel_l2"] for r in rep.ops) < 1e-6
    # the last chunk's head is the host's chunked simulation's logits (workflows.host_logits: its own pass)
    ref = host_logits(qm, tokens40, 16).astype(np.float64)
    assert by["lm_head"]["sim"]["l2"] == pytest.approx(np.linalg.norm(ref), rel=1e-6)
    assert 1e-3 < by["c1.l0.attn_q"]["scheme_vs_float"]["rel_l2"] < 0.2
    # a one-code fault in chunk 1 is named with its chunk; it reaches chunk 2 through the keys of the next layer only
    fault = {"op": "c1.l2.ffn_down", "index": 3, "codes": 1}
    rep = agent.prefill_chunked(qm, tokens40, chunk=16, scheduler="ooo", progress=False,
                                numerics={"ops": "blk.2.*,blk.3.*", "fault": fault}).numerics
    assert (rep.first_divergent["op"], rep.first_divergent["chunk"]) == ("c1.l2.ffn_down", 1), rep.first_divergent
    by = rep.by_name()
    assert all(r["device_vs_sim"]["rel_l2"] == 0 for r in rep.ops if r["chunk"] == 0)
    assert by["c2.l2.attention"]["device_vs_sim"]["rel_l2"] == 0  # chunk 1's layer-2 keys came before the fault
    assert by["c2.l3.attention"]["device_vs_sim"]["rel_l2"] > 0


@pytest.mark.parametrize("strategy", ["row-cut", "seq-cut"])
def test_a_hetero_split_compares_each_piece_with_its_block_and_the_join_as_the_linear(agent, qm, heldout_ids,
                                                                                       strategy):
    """HeteroLLM §4.1: each int8 GEMM cut between the npu and gpu lanes (45 rows: the npu's 32 and the gpu's 13, or
    the output columns): each piece against its block of the host's linear, the join under the linear's name."""
    from edgeprobe.schedule.hetero import SNAPDRAGON_HETERO

    toks = np.asarray(heldout_ids[:45], np.int32)
    rep = agent.prefill_hetero(qm, toks, SNAPDRAGON_HETERO, strategy, progress=False,
                               numerics={"ops": "blk.0.*"}).numerics
    by = rep.by_name()
    npu, gpu, join = by["blk.0.attn_q.npu0"], by["blk.0.attn_q.gpu"], by["blk.0.attn_q"]
    assert join["device_op"] == "blk.0.attn_q.cat" and "part" not in join and join["shape"] == [45, 576]
    assert npu["host_op"] == gpu["host_op"] == "blk.0.attn_q" and npu["kind"] == "attn_q" and npu["layer"] == 0
    if strategy == "seq-cut":
        assert (npu["part"]["rows"], gpu["part"]["rows"]) == ((0, 32), (32, 45)) and gpu["shape"] == [13, 576]
    else:
        c = npu["part"]["cols"][1]
        assert npu["part"]["cols"] == (0, c) and gpu["part"]["cols"] == (c, 576) and 0 < c < 576
    # the pieces tile the linear's output: their squared norms add up to the join's
    assert npu["sim"]["l2"] ** 2 + gpu["sim"]["l2"] ** 2 == pytest.approx(join["sim"]["l2"] ** 2, rel=1e-9)
    assert rep.first_divergent is None and all(r["device_vs_sim"]["max_abs"] == 0 for r in rep.ops)  # int8: exact
    fault = {"op": "blk.1.ffn_up.gpu", "index": 3, "codes": 1}
    rep = agent.prefill_hetero(qm, toks, SNAPDRAGON_HETERO, strategy, progress=False,
                               numerics={"ops": "blk.1.*", "fault": fault}).numerics
    by = rep.by_name()
    assert rep.first_divergent["op"] == "blk.1.ffn_up.gpu", rep.first_divergent
    assert by["blk.1.ffn_up.npu0"]["device_vs_sim"]["max_abs"] == 0 and by["blk.1.ffn_up"]["device_vs_sim"][
        "max_abs"] == pytest.approx(by["blk.1.ffn_up.gpu"]["device_vs_sim"]["max_abs"], rel=1e-6)


def test_an_agent_deployed_over_ssh_captures_and_names_a_fault(sshd, tmp_path, free_port, qm, tokens8):
    import os
    import sys

    user = os.environ.get("USER") or __import__("getpass").getuser()
    dev = Device.ssh("127.0.0.1", user, sshd["key"], port=sshd["port"], python=sys.executable,
                     known_hosts=sshd["known_hosts"], remote_dir=str(tmp_path / "remote"), agent_port=free_port(),
                     progress=False)
    try:
        rep = prefill_numerics(dev, qm, tokens8, ops="blk.1.*,lm_head").numerics
        assert len(rep.ops) == 16 and rep.first_divergent is None and rep.meta["full_captured"] == 16
        assert max(r["device_vs_sim"]["rel_l2"] for r in rep.ops) < 1e-6
        rep = prefill_numerics(dev, qm, tokens8, ops="blk.1.*", fault={"op": "blk.1.ffn_norm", "index": 3}).numerics
        assert rep.first_divergent["op"] == "blk.1.ffn_norm", rep.first_divergent
    finally:
        dev.close()


def test_run_cli_captures_a_chunked_prefill_and_decode_steps(tmp_path):
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "edgeprobe", "run", "--model", "smollm2-135m", "--scheme", "w8a8", "--no-progress",
            "--store", str(tmp_path / "store"), "--numerics", "--numerics-ops", "blk.1.*", "--json"]
    r = subprocess.run(base + ["--prompt-len", "40", "--scheduler", "ooo", "--chunk", "16"], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    nm = json.loads(r.stdout.strip().splitlines()[-1])["numerics"]
    assert nm["ops"] == 3 * 15 and nm["first_divergent"] is None and nm["max_device_vs_sim"]["op"].startswith("c")
    r = subprocess.run(base + ["--prompt-len", "8", "--decode", "2", "--numerics-out", str(tmp_path / "n")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    nm = out["numerics"]
    assert (nm["steps"], nm["ops"], nm["first_divergent"]) == (2, 3 * 15, None) and len(out["fed"]) == 2
    assert max(nm["per_step_max_rel_l2"]) < 1e-6
    saved = json.loads((tmp_path / "n" / "numerics.json").read_text())
    assert saved["format"] == "edgeprobe-numerics-decode/1" and saved["decode_steps"] == 2
    r = subprocess.run(base + ["--prompt-len", "8", "--decode", "2", "--batch", "2"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "edgeprobe: error: --numerics with --decode follows one sequence's greedy steps: leave --batch at 1 and "
        "--temperature at 0")
