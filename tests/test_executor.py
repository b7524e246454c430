"""The agent's executor in-process: the same op registry and lanes, without a socket."""

import numpy as np
import pytest

from edgeprobe_agent.executor import Context, PlanError, execute, validate
from edgeprobe_agent.ops import OpError


def _plan():
    # two independent chains on two lanes, joined at the end
    ops = []
    for lane in ("cpu", "npu"):
        prev = {"input": "x"}
        for i in range(3):
            ops.append({"name": f"{lane}{i}", "kind": "add", "lane": lane, "inputs": [prev, {"input": "x"}]})
            prev = {"op": f"{lane}{i}"}
    ops.append({"name": "join", "kind": "add", "lane": "cpu", "inputs": [{"op": "cpu2"}, {"op": "npu2"}]})
    return {"ops": ops, "outputs": ["join"]}


def test_in_process_run_respects_dependencies_and_lanes():
    plan = validate(_plan(), has_blob=lambda s: False)
    seen = []
    out, events = execute(plan, {"x": np.ones((4, 4), np.float32)}, Context(get=None), on_op=seen.append)
    assert np.array_equal(out["join"], np.full((4, 4), 8, np.float32))
    by = {e["name"]: e for e in events}
    assert by["join"]["start_us"] >= max(by["cpu2"]["end_us"], by["npu2"]["end_us"])
    assert all(by[f"cpu{i}"]["end_us"] <= by[f"cpu{i + 1}"]["start_us"] for i in range(2))
    assert by["npu0"]["emulated"] and not by["cpu0"]["emulated"] and len(seen) == 7


def test_op_failure_is_reported_not_raised_from_a_thread():
    embed = {"name": "e", "kind": "embed", "lane": "cpu", "inputs": [{"input": "t"}, {"input": "w"}]}
    plan = validate({"ops": [embed]},
                    has_blob=lambda s: False)
    # the op's own error crosses the lane thread unchanged: its code is what the agent's error reply carries
    with pytest.raises(OpError, match=r"token ids outside \[0, 3\)") as e:
        execute(plan, {"t": np.array([5]), "w": np.zeros((3, 2), np.float32)}, Context(get=None))
    assert e.value.code == "bad_input"
    with pytest.raises(PlanError, match="a plan is a map") as e:
        validate([], has_blob=lambda s: False)
    assert e.value.code == "bad_plan"


def test_running_out_of_file_descriptors_says_what_to_raise(monkeypatch):
    import errno

    from edgeprobe_agent import ops

    def add(args, attrs, ctx):  # as a blob's mapping fails once the agent holds its limit of descriptors
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setitem(ops.OPS, "add", add)
    plan = validate({"ops": [{"name": "a", "kind": "add", "lane": "cpu", "inputs": [{"input": "x"}, {"input": "x"}]}]},
                    has_blob=lambda s: False)
    with pytest.raises(OpError, match=r"Too many open files.*raise the agent's hard limit on open files") as e:
        execute(plan, {"x": np.ones(2, np.float32)}, Context(get=None))
    assert e.value.code == "op_failed"


def test_an_output_no_later_op_reads_is_dropped_during_the_run():
    import tracemalloc

    # a 200-op chain of 1 MB adds on two lanes, with a side branch every 50 ops read at the end: kept all, it
    # held 200 MB until the run ended (a 256-token prefill held ~400 MB: every op faulted in fresh pages)
    ops, prev = [], {"input": "x"}
    for i in range(200):
        ops.append({"name": f"a{i}", "kind": "add", "lane": ("cpu", "npu")[i % 2], "inputs": [prev, {"input": "x"}]})
        prev = {"op": f"a{i}"}
    ops.append({"name": "side", "kind": "add", "lane": "cpu",
                "inputs": [{"op": "a49"}, {"op": "a149"}, {"op": "a199"}]})
    plan = validate({"ops": ops, "outputs": ["side", "a99"]}, has_blob=lambda s: False)
    x = np.ones((512, 512), np.float32)
    # the first run in a process imports and types numba's kernels (~15 MB of Python objects, no output of the run's):
    # run alone, the test measured that; after the suite's earlier tests, not
    execute(validate({"ops": ops[:2], "outputs": ["a1"]}, has_blob=lambda s: False), {"x": x}, Context(get=None))
    tracemalloc.start()
    try:
        out, events = execute(plan, {"x": x}, Context(get=None))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(out["a99"], np.full_like(x, 101))
    assert np.array_equal(out["side"], np.full_like(x, 51 + 151 + 201))
    assert len(events) == 201 and peak < 12 * x.nbytes  # the outputs and the ops in flight, not the whole chain


def test_a_shadow_delta_beside_its_int8_gemm_leaves_the_gemm_every_core():
    from edgeprobe_agent.ops import runs_beside
    from edgeprobe_agent.threads import Cores

    # mllm-NPU's shadow delta is a side op: one thread, and the npu GEMM starting while it runs still gets both
    # cores (it got one when the delta had started first: 940 us against 220 us for a 64-row GEMM)
    assert runs_beside("linear", {"part": "shadow"}) and not runs_beside("linear", {"part": "int8"})
    assert not runs_beside("attention", {})
    c = Cores(cores=2)
    c.enabled = True  # the counting alone: no BLAS or numba setters in this process
    assert c.enter(side=True) == 1
    assert c.enter() == 2  # the GEMM beside the delta
    assert c.enter() == 1  # another full op on a third lane: the cores are taken
    c.leave()
    c.leave()
    c.leave(side=True)
    assert c.enter() == 2  # all left: an op alone gets every core again
    c.leave()


def test_a_plan_on_one_lane_takes_the_cores_once_and_gives_them_back(monkeypatch):
    from edgeprobe_agent import executor
    from edgeprobe_agent.threads import Cores

    c = Cores(cores=2)
    c.enabled = True  # the counting alone
    calls = []
    enter, leave = c.enter, c.leave
    monkeypatch.setattr(c, "enter", lambda side=False: calls.append("enter") or enter(side))
    monkeypatch.setattr(c, "leave", lambda side=False: calls.append("leave") or leave(side))
    monkeypatch.setattr(executor, "CORES_IN_USE", c)
    cpu_only = {"ops": [op for op in _plan()["ops"] if op["name"].startswith("cpu")], "outputs": ["cpu2"]}
    plan = validate(cpu_only, has_blob=lambda s: False)
    out, events = execute(plan, {"x": np.ones((4, 4), np.float32)}, Context(get=None))
    assert calls == ["enter", "leave"] and [e["threads"] for e in events] == [2, 2, 2]  # a decode step's ops alone
    assert np.array_equal(out["cpu2"], np.full((4, 4), 4, np.float32))
    with pytest.raises(OpError):  # a failing op still gives the cores back
        embed = {"name": "e", "kind": "embed", "lane": "cpu", "inputs": [{"input": "t"}, {"input": "w"}]}
        execute(validate({"ops": [embed]},
                         has_blob=lambda s: False), {"t": np.array([5], np.int32), "w": np.ones((3, 2), np.float32)},
                Context(get=None))
    assert calls[-2:] == ["enter", "leave"] and c.enter() == 2  # nothing left counted busy
    c.leave()
    calls.clear()
    execute(validate(_plan(), has_blob=lambda s: False), {"x": np.ones((4, 4), np.float32)}, Context(get=None))
    assert calls.count("enter") == 7 == calls.count("leave")  # two lanes: each op counts itself
