"""The numerics capture's maths (edgeprobe_kernels.numerics) against numpy directly, the executor's capture hook, and
the host capture at the template's op names (edgeprobe.numerics)."""
import numpy as np
import pytest

from edgeprobe_kernels.numerics import HIST_BINS, HIST_LO, Capture, CaptureError, select, summarize


def _ref_hist(x):
    f = np.asarray(x, np.float32).reshape(-1)
    f = f[np.isfinite(f) & (f != 0)]
    e = np.floor(np.log2(np.abs(f).astype(np.float64))).astype(np.int64)
    return np.bincount(np.clip(e - HIST_LO, 0, HIST_BINS - 1), minlength=HIST_BINS)


BOTH = pytest.mark.parametrize("use_numba", [True, False], ids=["numba", "numpy"])


@BOTH
def test_summary_of_a_random_tensor_matches_numpy(use_numba):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((37, 53)) * np.exp(rng.uniform(-20, 20, (37, 53)))).astype(np.float32)
    s = summarize(x, use_numba)
    d = x.astype(np.float64)
    assert s["shape"] == [37, 53] and s["dtype"] == "float32" and s["size"] == x.size
    assert s["l2"] == pytest.approx(np.linalg.norm(d), rel=1e-12)
    assert s["max_abs"] == np.abs(d).max() and s["mean"] == pytest.approx(d.mean(), rel=1e-12, abs=1e-300)
    assert s["nonfinite"] == 0 and s["zeros"] == 0
    assert s["hist"] == _ref_hist(x).tolist() and sum(s["hist"]) == x.size


@BOTH
def test_histogram_bins_are_floor_log2_with_clamped_ends_and_special_values_counted_apart(use_numba):
    x = np.array([1.0, 1.5, 2.0, -3.99, 0.5, 2.0 ** -40, 1e-45, 2.0 ** 40, 0.0, -0.0, np.inf, -np.inf, np.nan],
                 np.float32)
    s = summarize(x, use_numba)
    h = s["hist"]
    assert h[0 - HIST_LO] == 2        # 1.0, 1.5: floor(log2) 0
    assert h[1 - HIST_LO] == 2        # 2.0, -3.99: floor(log2) 1
    assert h[-1 - HIST_LO] == 1       # 0.5
    assert h[0] == 2                  # 2^-40 and a subnormal: clamped into the bottom bin
    assert h[-1] == 1                 # 2^40: clamped into the top bin
    assert sum(h) == 8 and s["zeros"] == 2 and s["nonfinite"] == 3
    finite = x[np.isfinite(x)].astype(np.float64)
    assert s["l2"] == pytest.approx(np.linalg.norm(finite), rel=1e-12) and s["max_abs"] == 2.0 ** 40
    assert s["hist"] == _ref_hist(x).tolist()


@BOTH
def test_summary_of_integer_and_empty_tensors(use_numba):
    s = summarize(np.arange(-3, 5, dtype=np.int32), use_numba)
    assert s["dtype"] == "int32" and s["l2"] == pytest.approx(np.sqrt(sum(i * i for i in range(-3, 5))))
    assert s["zeros"] == 1 and s["mean"] == 0.5 and s["max_abs"] == 4
    e = summarize(np.zeros((0, 4), np.float32), use_numba)
    assert e["size"] == 0 and e["l2"] == 0 and sum(e["hist"]) == 0


def test_select_takes_comma_separated_globs_in_plan_order():
    names = ["embed", "blk.0.attn_q", "blk.1.attn_q", "blk.10.attn_q", "blk.1.ffn_up", "lm_head"]
    assert select(names, None) == names
    assert select(names, "blk.1.*") == ["blk.1.attn_q", "blk.1.ffn_up"]
    assert select(names, "lm_head, *.attn_q") == ["blk.0.attn_q", "blk.1.attn_q", "blk.10.attn_q", "lm_head"]
    assert select(names, "blk.9.*") == []


def test_capture_refuses_a_pattern_naming_nothing_and_a_full_capture_over_its_limit():
    with pytest.raises(CaptureError, match=r"'blk\.99\.\*' names no op") as e:
        Capture(["a", "b"], "blk.99.*")
    assert e.value.code == "bad_request"
    cap = Capture(["a", "b"], None, full=["a", "b"], limit_bytes=600)
    cap.take("a", np.ones(100, np.float32))
    with pytest.raises(CaptureError, match="800 bytes, over the limit of 600 bytes") as e:
        cap.take("b", np.ones(100, np.float32))
    assert e.value.code == "memory_budget"
    assert Capture.of_request(None, ["a"]) is None
    with pytest.raises(CaptureError, match="glob pattern"):
        Capture.of_request({"ops": 3}, ["a"])


def test_the_test_only_fault_moves_one_element_by_one_code():
    x = np.linspace(-2, 1, 12, dtype=np.float32)
    cap = Capture(["a"], None, full=["a"], fault={"op": "a", "index": 3, "codes": 1})
    y = cap.take("a", x)
    assert np.flatnonzero(y != x).tolist() == [3] and y[3] - x[3] == pytest.approx(2 / 127)
    assert cap.summaries[0]["l2"] == pytest.approx(np.linalg.norm(y.astype(np.float64)))


def test_the_fault_lands_in_a_transposed_output_too():
    # numpy's int8 GEMMs (the arm64 agent's npu lane) hand back (W @ x.T).T: a Fortran-ordered view
    x = np.arange(12, dtype=np.float32).reshape(3, 4).T
    assert not x.flags.c_contiguous
    y = Capture(["a"], None, fault={"op": "a", "index": 1, "codes": 127}).take("a", x)
    assert np.argwhere(y != x).tolist() == [[0, 1]] and y[0, 1] - x[0, 1] == 11


def test_the_executor_captures_chosen_ops_with_their_own_trace_events():
    from edgeprobe_agent.executor import Context, execute, validate

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    plan = validate({"ops": [{"name": "x", "kind": "add", "lane": "cpu", "inputs": [{"input": "a"}, {"input": "a"}]},
                             {"name": "y", "kind": "add", "lane": "npu", "inputs": [{"op": "x"}, {"input": "a"}]}],
                     "outputs": ["y"]}, has_blob=lambda s: True)
    cap = Capture(plan.order, "y", full=["y"], fault=None)
    outs, events = execute(plan, {"a": a}, Context(get=None, numerics=cap))
    assert [s["op"] for s in cap.summaries] == ["y"] and cap.summaries[0]["l2"] == pytest.approx(np.linalg.norm(3 * a))
    assert np.array_equal(cap.tensors[0][1], 3 * a)
    ev = {e["name"]: e for e in events}
    assert ev["numerics:y"]["lane"] == "npu" and ev["numerics:y"]["kind"] == "numerics"
    assert ev["numerics:y"]["start_us"] >= ev["y"]["end_us"] and "numerics:x" not in ev
    # a fault at x flows on into y, as a kernel's wrong output would
    cap = Capture(plan.order, None, fault={"op": "x", "index": 0, "codes": 127})
    outs2, _ = execute(plan, {"a": a}, Context(get=None, numerics=cap))
    assert outs2["y"][0, 0] == outs["y"][0, 0] + 10 and (outs2["y"].reshape(-1)[1:] == outs["y"].reshape(-1)[1:]).all()


def test_distances_of_a_known_pair_full_and_summary():
    from edgeprobe.numerics import compare

    # integers times 1 + 2^-10 stay exact in float32 (21 bits): dev - sim is sim * 2^-10 to the last bit
    rng = np.random.default_rng(3)
    sim_a = rng.integers(-1000, 1001, (4, 96)).astype(np.float32)
    eps = 2.0 ** -10
    dev_a = sim_a * np.float32(1 + eps)
    assert np.array_equal(dev_a.astype(np.float64) - sim_a, sim_a.astype(np.float64) * eps)
    sim_l2 = float(np.linalg.norm(sim_a.astype(np.float64)))
    full_rel = float(np.linalg.norm(dev_a.astype(np.float64) - sim_a)) / sim_l2
    summary_rel = abs(float(np.linalg.norm(dev_a.astype(np.float64))) - sim_l2) / sim_l2  # | ||a|| - ||b|| | / ||b||
    max_abs = float(np.abs(sim_a).max()) * eps
    flip = -sim_a  # same norm and max |x|: the summaries cannot see it, the full tensors can (||2b|| / ||b|| = 2)
    dev = {"x": summarize(dev_a), "flip": summarize(flip)}
    sim = {"x": summarize(sim_a), "flip": summarize(sim_a)}
    full = compare(dev, sim, None, 1, 1e-6, {"x": dev_a, "flip": flip}, {"x": sim_a, "flip": sim_a}).by_name()
    summ = compare(dev, sim, None, 1, 1e-6).by_name()
    assert full["x"]["device_vs_sim"]["method"] == "full" and summ["x"]["device_vs_sim"]["method"] == "summary"
    assert full_rel == pytest.approx(eps, rel=1e-12) and summary_rel == pytest.approx(eps, rel=1e-9)
    assert full["x"]["device_vs_sim"]["rel_l2"] == pytest.approx(full_rel, rel=1e-12)
    assert full["x"]["device_vs_sim"]["max_abs"] == max_abs
    assert summ["x"]["device_vs_sim"]["rel_l2"] == pytest.approx(summary_rel, rel=1e-9)
    assert summ["x"]["device_vs_sim"]["max_abs"] == max_abs
    assert full["flip"]["device_vs_sim"]["rel_l2"] == pytest.approx(2.0, rel=1e-12)
    assert full["flip"]["device_vs_sim"]["max_abs"] == 2 * float(np.abs(sim_a).max())
    assert summ["flip"]["device_vs_sim"] == {"rel_l2": 0.0, "max_abs": 0.0, "max_rel": 0.0, "method": "summary"}


def test_host_capture_of_the_float_plan_has_distance_zero_to_itself(smollm):
    from edgeprobe.numerics import compare, host_numerics

    toks = np.arange(100, 108)
    a, fa = host_numerics(smollm, toks, "blk.0.*,lm_head", full=["blk.0.ffn_down", "lm_head"])
    b, fb = host_numerics(smollm, toks, "blk.0.*,lm_head", full=["blk.0.ffn_down", "lm_head"])
    assert list(a)[:3] == ["blk.0.attn_norm", "blk.0.attn_q", "blk.0.attn_k"] and "lm_head" in a
    assert a["lm_head"]["shape"] == [1, smollm.config.vocab_size]
    rep = compare(a, b, b, smollm.config.n_layers, 1e-6, fa, fb, fb)
    assert rep.first_divergent is None and len(rep.ops) == len(a)
    assert all(r["device_vs_sim"]["rel_l2"] == 0 and r["device_vs_sim"]["max_abs"] == 0 for r in rep.ops)
    assert rep.by_name()["lm_head"]["device_vs_sim"]["method"] == "full"
    assert rep.by_name()["blk.0.attn_q"]["device_vs_sim"]["method"] == "summary"
    # the host's lm_head capture is the forward pass's own logits
    from edgeprobe.forward import forward
    assert np.array_equal(fa["lm_head"], forward(smollm, toks, logits="last")[None])


def test_one_element_off_by_a_code_is_named_by_max_rel_under_the_l2_tolerance():
    """A flipped input code moves few elements: relative L2 stays under 1e-4, max |diff| / max |x| does not."""
    from edgeprobe.numerics import DEFAULT_MAX_TOLERANCE, DEFAULT_TOLERANCE, compare, tolerances

    sim = np.full((64, 256), 0.5, np.float32)  # ||sim|| = 0.5 * 128 = 64, max |sim| = 0.5
    sim[0, 0] = 2.0                            # max |sim| = 2; ||sim||^2 = 4096 - 0.25 + 4
    dev = sim.copy()
    dev[7, 9] += np.float32(2.0 ** -10)        # one element off by 2^-10: max_rel 2^-11 = 4.9e-4, rel L2 1.5e-5
    l2 = float(np.sqrt(4096 - 0.25 + 4))
    caps = ({"y": summarize(dev)}, {"y": summarize(sim)})
    rep = compare(*caps, None, 1, DEFAULT_TOLERANCE, {"y": dev}, {"y": sim})
    d = rep.by_name()["y"]["device_vs_sim"]
    assert d["rel_l2"] == pytest.approx(2.0 ** -10 / l2, rel=1e-9) and d["rel_l2"] < DEFAULT_TOLERANCE
    assert d["max_abs"] == 2.0 ** -10 and d["max_rel"] == 2.0 ** -11
    assert rep.first_divergent == {"op": "y", "layer": 1, "kind": "y", **d, "by": "max_rel"}
    assert rep.to_json()["max_tolerance"] == DEFAULT_MAX_TOLERANCE
    # max_rel off: the same pair does not diverge; an L2 tolerance under its error names it by rel_l2
    assert compare(*caps, None, 1, DEFAULT_TOLERANCE, {"y": dev}, {"y": sim}, max_tolerance=None).first_divergent \
        is None
    assert compare(*caps, None, 1, 1e-5, {"y": dev}, {"y": sim}).first_divergent["by"] == "rel_l2"
    # float16 schemes default to looser bounds than the int8 ones (float16 rounding is not a fault)
    assert tolerances("w8a8") == (DEFAULT_TOLERANCE, DEFAULT_MAX_TOLERANCE) == tolerances(None)
    rel, mx = tolerances("q4_0-tile")
    assert rel > DEFAULT_TOLERANCE and mx > DEFAULT_MAX_TOLERANCE


def test_a_fused_op_s_sub_ops_are_captured_by_name_with_their_own_events_and_a_fault_flows_on():
    """A decode step is one fused op on the agent: capture names and takes its sub-ops, as the host names them."""
    from edgeprobe.numerics import plan_op_names
    from edgeprobe_agent.executor import Context, capture_names, execute, validate

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    raw = {"ops": [{"name": "f", "kind": "fused", "lane": "cpu", "inputs": [{"input": "a"}],
                    "attrs": {"ops": [{"name": "x", "kind": "add", "inputs": [{"arg": 0}, {"arg": 0}]},
                                      {"name": "y", "kind": "add", "inputs": [{"op": "x"}, {"arg": 0}]}]}}],
           "outputs": ["f"]}
    plan = validate(raw, has_blob=lambda s: True)
    assert capture_names(plan) == plan_op_names(raw) == ["x", "y"]
    cap = Capture(capture_names(plan), "x", full=["x"])
    outs, events = execute(plan, {"a": a}, Context(get=None, numerics=cap))
    assert [s["op"] for s in cap.summaries] == ["x"] and np.array_equal(cap.tensors[0][1], 2 * a)
    ev = {e["name"]: e for e in events}
    assert ev["numerics:x"]["kind"] == "numerics" and ev["numerics:x"]["lane"] == "cpu"
    assert ev["numerics:x"]["deps"] == ["x"] and "numerics:y" not in ev
    cap = Capture(capture_names(plan), None, fault={"op": "x", "index": 0, "codes": 127})
    outs2, _ = execute(plan, {"a": a}, Context(get=None, numerics=cap))
    assert outs2["f"][0, 0] == outs["f"][0, 0] + 10 and [s["op"] for s in cap.summaries] == ["x", "y"]


def test_a_decode_loop_s_captures_carry_their_step_and_a_fault_lands_in_its_step_alone():
    cap = Capture(["a"], None, full=["a"], fault={"op": "a", "index": 0, "codes": 127, "step": 1})
    x = np.ones(4, np.float32)
    outs = []
    for step in range(3):
        cap.step = step
        outs.append(cap.take("a", x))
    assert [o[0] for o in outs] == [1, 2, 1] and [s["step"] for s in cap.summaries] == [0, 1, 2]
    reply, frames = cap.reply()
    assert reply["version"] == 2 and reply["full"] == ["a"] * 3 and reply["full_steps"] == [0, 1, 2]
    assert [f[0] for f in frames] == [1, 2, 1]
    # a fault that could never land is refused, naming it
    with pytest.raises(CaptureError, match=r"fault op 'b\.sum' is not an op of the plan"):
        Capture(["a", "b"], None, fault={"op": "b.sum"})
    with pytest.raises(CaptureError, match=r"fault op 'b' is not among the ops captured"):
        Capture(["a", "b"], "a", fault={"op": "b"})
    # outside a loop a stepped fault does nothing, one without a step lands every time
    assert Capture(["a"], None, fault={"op": "a", "codes": 127, "step": 0}).take("a", x)[0] == 1
    assert "full_steps" not in Capture(["a"], None, full=["a"]).reply()[0]
