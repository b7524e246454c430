"""A q4_0-tile decode step wholly on the npu lane (toolkit/graph/place.py step_on_one_lane): one fused op whose
sub-ops compute what the lane-split step computes, bit for bit; other schemes' steps keep their lanes."""
import numpy as np
import pytest
from test_graph import step_after_prompt, toy_model

from edgeprobe.plan import prefill_plan
from edgeprobe.quant import calibration_profile, quantize


def _lanes(plan):
    return {o["lane"] for o in plan["ops"]}


def test_a_q4_0_tile_step_on_the_npu_lane_is_one_op_with_the_split_steps_bits():
    m = toy_model(layers=3, hidden=32)
    qm = quantize(m, "q4_0-tile")
    cfg = qm.manifest["config"]
    split = prefill_plan(qm.manifest, 1, session=True, one_lane=False)
    one = prefill_plan(qm.manifest, 1, session=True, one_lane=True)
    assert _lanes(split) == {"cpu", "npu"} and len(split["ops"]) > 1
    (step,) = one["ops"]
    assert step["name"] == "step" and step["kind"] == "fused" and step["lane"] == "npu" and one["outputs"] == ["step"]
    assert one["meta"]["step_lane"] == "npu"
    names = [s["name"] for s in step["attrs"]["ops"]]
    assert names[0] == "embed" and names[-2:] == ["output_norm", "lm_head"]
    assert [n for n in names if n.count(".") == 1] == [f"blk.{i}" for i in range(cfg["n_layers"])]
    prompt = np.arange(7, dtype=np.int32) % cfg["vocab_size"]
    outs = []
    for plan in (split, one):
        out, events = step_after_prompt(qm, plan, prompt)
        outs.append(out)
        if plan is one:  # every sub-op's event on the npu lane, emulated there (its semantics on this CPU)
            assert {e["lane"] for e in events} == {"npu"} and all(e["emulated"] for e in events)
            assert [e["name"] for e in events] == names
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


@pytest.mark.parametrize("scheme", ["w8a8", "float"])
def test_steps_whose_linears_are_not_on_the_npu_lane_keep_their_lanes(scheme):
    m = toy_model(layers=2, hidden=32)
    if scheme == "w8a8":
        qm = quantize(m, scheme, calibration_profile(m, np.arange(60) % 48, tokens=60, window=30, progress=False))
    else:
        qm = quantize(m, scheme)
    a = prefill_plan(qm.manifest, 1, session=True, one_lane=True)
    b = prefill_plan(qm.manifest, 1, session=True, one_lane=False)
    assert a == b and "step_lane" not in a["meta"]
    assert _lanes(prefill_plan(qm.manifest, 4, session=True, one_lane=True)) == _lanes(
        prefill_plan(qm.manifest, 4, session=True, one_lane=False))  # prefill plans: untouched


def test_an_agent_whose_npu_lane_runs_hexagon_code_keeps_the_lane_split_step():
    from edgeprobe.plan import one_lane_for

    assert one_lane_for({"backends": {"npu": {"chosen": "numba"}}}) and one_lane_for({})
    assert not one_lane_for({"backends": {"npu": {"chosen": "hvx"}}})  # its norms would carry the "isa" label
