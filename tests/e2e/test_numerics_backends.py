"""Numerics capture on the agents that run other machine code (issue 41): the emulated arm64 agent (numpy kernels
under qemu-aarch64, as tests/e2e/test_arm64.py starts it) and the hvx agent (its npu lane Hexagon code under
qemu-hexagon, as tests/e2e/test_hvx_agent.py), and a plan that splits linears (w8a8c-shadow, local agent). SmolLM2
under w8a8, an 8-token prefill (the emulation is slow).

Measured here: the hvx agent's every op equals the host's simulation bit for bit (int8 GEMMs exact, the cpu lane is
the host's own numba). On arm64 the npu lane's int8 linears are exact given their inputs, while the float32 parts
(norms, swiglu, the head) round in their last bits against x86's: max device-vs-simulation relative L2 3.7e-7
(lm_head), max |diff| 2.3e-5. A one-code fault reads ~5e-4 to 2e-3 at its op.
"""
import numpy as np
import pytest

from edgeprobe.device import Device
from edgeprobe.numerics import prefill_numerics
from edgeprobe.plan import prefill_plan

ARM64_FLOAT_REL_L2 = 2e-6   # arm64 vs x86 float32 rounding, per op (measured 3.7e-7): far under one code (~5e-4)
FAULT_OPS = "blk.1.*,blk.2.*"


@pytest.fixture(scope="module")
def qm(smollm):
    from edgeprobe.prepare import prepared

    return prepared(smollm, "w8a8", progress=False)


@pytest.fixture(scope="module")
def tokens(heldout_ids):
    return np.asarray(heldout_ids[:8], np.int32)


@pytest.fixture(scope="module")
def plan_ops(qm, tokens):
    """{op name: plan op} of the 8-token prefill, in plan order."""
    return {o["name"]: o for o in prefill_plan(qm.manifest, len(tokens))["ops"]}


@pytest.fixture(scope="module")
def arm64_agent(tmp_path_factory):
    d = Device.local(store=tmp_path_factory.mktemp("arm64-numerics"), arch="arm64")
    yield d
    d.close()


@pytest.fixture(scope="module")
def hvx_agent(tmp_path_factory, hvx_toolchain):
    d = Device.local(store=tmp_path_factory.mktemp("hvx-numerics"), npu_backend="hvx", lanes=["cpu", "npu"])
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


def _fault_is_first(agent, qm, tokens, plan_ops, op):
    """A one-code fault at `op` (one int8 step at its per-tensor scale): it, by name, is the first divergent op."""
    rep = prefill_numerics(agent, qm, tokens, ops=FAULT_OPS, fault={"op": op, "index": 3, "codes": 1}).numerics
    assert rep.first_divergent["op"] == op, rep.first_divergent
    by = rep.by_name()
    assert by[op]["device_vs_sim"]["max_abs"] == pytest.approx(by[op]["device"]["max_abs"] / 127, rel=1e-2)
    return rep


def test_arm64_captures_every_op_int8_linears_exact_float_parts_to_rounding(arm64_agent, qm, tokens, plan_ops):
    assert arm64_agent.info["machine"] == "aarch64" and arm64_agent.info["backends"]["npu"]["kernels"] == "numpy"
    res = prefill_numerics(arm64_agent, qm, tokens)
    rep = res.numerics
    ops = _captured_as_asked(res, [n for n, o in plan_ops.items() if o["lane"] != "io"])
    assert rep.meta["full_captured"] == len(rep.ops) and rep.first_divergent is None
    assert all(ops[r["op"]]["backend"] == "numpy" for r in rep.ops)
    worst = max(rep.ops, key=lambda r: r["device_vs_sim"]["rel_l2"])
    assert worst["device_vs_sim"]["rel_l2"] < ARM64_FLOAT_REL_L2, worst
    # each npu-lane int8 linear, run by the host's simulation on the device's own input, gives the device's output
    # bit for bit: whatever differs there came in through the float32 parts upstream
    linears = [n for n, o in plan_ops.items() if o["lane"] == "npu"]
    assert len(linears) == 7 * qm.model.config.n_layers
    for n in linears:
        x = rep.device_full[plan_ops[n]["inputs"][0]["op"]]
        assert np.array_equal(qm.linear(n, x), rep.device_full[n]), n


def test_arm64_names_a_seeded_fault_in_a_cpu_lane_op_and_in_an_npu_lane_linear(arm64_agent, qm, tokens, plan_ops):
    assert plan_ops["blk.1.ffn_norm"]["lane"] == "cpu" and plan_ops["blk.1.ffn_up"]["lane"] == "npu"
    _fault_is_first(arm64_agent, qm, tokens, plan_ops, "blk.1.ffn_norm")
    # numpy's int8 GEMMs hand back a transposed array: the fault must land in it all the same
    _fault_is_first(arm64_agent, qm, tokens, plan_ops, "blk.1.ffn_up")


def test_hvx_captures_every_op_equal_to_the_simulation_and_names_a_fault_in_hexagon_code(hvx_agent, qm, tokens,
                                                                                         plan_ops):
    assert hvx_agent.info["backends"]["npu"]["chosen"] == "hvx"
    res = prefill_numerics(hvx_agent, qm, tokens)
    rep = res.numerics
    ops = _captured_as_asked(res, [n for n, o in plan_ops.items() if o["lane"] != "io"])
    assert rep.meta["full_captured"] == len(rep.ops) and rep.first_divergent is None
    npu = [n for n, o in plan_ops.items() if o["lane"] == "npu"]
    assert npu and all(ops[n]["emulated"] == "isa" and ops[n]["backend"] == "hvx" for n in npu)
    # the int8 path is exact on Hexagon code, the cpu lane is the host's own kernels: every op bit for bit
    assert all(r["device_vs_sim"]["max_abs"] == 0 and r["device_vs_sim"]["method"] == "full" for r in rep.ops)
    rep = _fault_is_first(hvx_agent, qm, tokens, plan_ops, "blk.1.ffn_up")
    assert all(r["device_vs_sim"]["max_abs"] == 0 for r in rep.ops[:rep.ops.index(rep.by_name()["blk.1.ffn_up"])])


def test_a_split_linear_is_compared_at_its_join_under_the_linear_s_name(dev, smollm, tokens):
    """w8a8c-shadow splits each linear into an int8 part (npu), a shadow part (cpu) and their join, "<linear>.sum":
    the join is the host's linear, compared under its name (the local agent: exact)."""
    from edgeprobe.prepare import prepared

    qm = prepared(smollm, "w8a8c-shadow", progress=False)
    names = [o["name"] for o in prefill_plan(qm.manifest, len(tokens))["ops"]]
    assert "blk.0.attn_q.sum" in names and "blk.0.attn_q" not in names
    rep = prefill_numerics(dev, qm, tokens).numerics
    by = rep.by_name()
    linears = [n for n in by if n.startswith("blk.") and n.split(".")[2] in ("attn_q", "ffn_up", "ffn_down")]
    assert len(linears) == 3 * qm.model.config.n_layers and "blk.0.attn_q.sum" not in by
    assert rep.first_divergent is None and all(r["device_vs_sim"]["max_abs"] == 0 for r in rep.ops)
    rep = prefill_numerics(dev, qm, tokens, ops="blk.1.*", fault={"op": "blk.1.attn_q.sum", "index": 3}).numerics
    assert rep.first_divergent["op"] == "blk.1.attn_q"
