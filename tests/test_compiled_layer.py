"""A fused W8A8 or q4_0-tile decode layer as one compiled call (device_agent/ops/compiled.py,
kernels/decode_layer.py): the sub-op path's logits and KV cache bit for bit, step after step; its events' fields;
the runs and plans it leaves to the sub-op path."""
import copy

import numpy as np
import pytest
from test_graph import toy_model

from edgeprobe.graph.local import host_session, run_plan
from edgeprobe.plan import prefill_plan
from edgeprobe.quant import calibration_profile, quantize
from edgeprobe_agent.ops import compiled
from edgeprobe_agent.ops.registry import OpError
from edgeprobe_kernels import decode_layer
from edgeprobe_kernels.simd import AVX2

# numba is a base dependency: only a CPU without AVX2 lacks the compiled layer (its fused layers run op by op)
pytestmark = pytest.mark.skipif(not AVX2, reason="the compiled layer needs an AVX2 CPU")


def _w8a8(heads=4, kv=2, layers=2, scheme="w8a8"):
    m = toy_model(layers=layers, hidden=32, heads=heads, kv=kv)
    if scheme == "q4_0-tile":  # no calibration: weights only
        return quantize(m, scheme)
    return quantize(m, scheme, calibration_profile(m, np.arange(60) % 48, tokens=60, window=30, progress=False))


def _decode(qm, on: bool, monkeypatch, steps=4, batch=1, capacity=16):
    """Greedy decode `steps` tokens after a 7-token prompt on a host session, compiled layers on or off:
    (each step's logits, the session, each step's events)."""
    monkeypatch.setattr(compiled, "ENABLED", on)
    cfg = qm.manifest["config"]
    prompt = np.tile(np.arange(7, dtype=np.int32) % cfg["vocab_size"], batch)
    sess = host_session(cfg, batch, capacity)
    run_plan(prefill_plan(qm.manifest, 7, batch=batch, session=True), qm.store.get, {"tokens": prompt}, sess, 7)
    step = prefill_plan(qm.manifest, 1, batch=batch, session=True)
    tok, logits, events = np.full(batch, 5, np.int32), [], []
    for _ in range(steps):
        out, ev, _ = run_plan(step, qm.store.get, {"tokens": tok}, sess, 1)
        y = np.asarray(out["step"]).reshape(batch, -1)
        logits.append(y.copy())
        events.append(ev)
        tok = y.argmax(axis=1).astype(np.int32)
    return logits, sess, events


@pytest.mark.parametrize("heads,kv,layers,scheme", [(4, 2, 2, "w8a8"), (4, 1, 3, "w8a8"), (2, 2, 1, "w8a8"),
                                                    (4, 2, 2, "q4_0-tile"), (4, 1, 3, "q4_0-tile")])
def test_a_compiled_decode_layer_gives_the_sub_op_paths_bits_step_after_step(heads, kv, layers, scheme, monkeypatch):
    """Layers chained in a step run as one call (compiled.run_layers); a step's one layer alone (compiled.run).
    q4_0-tile decodes on the npu lane: its GEMVs from codes (k and v columns padded to whole tiles in the toy)."""
    if scheme == "q4_0-tile" and decode_layer.layers_q4 is None:
        pytest.skip("this CPU has no F16C: q4_0-tile layers run op by op")
    calls = {"run": 0, "run_layers": 0}
    for name in calls:
        real = getattr(compiled, name)
        monkeypatch.setattr(compiled, name, lambda *a, real=real, name=name: calls.__setitem__(name, calls[name] + 1)
                            or real(*a))
    qm = _w8a8(heads, kv, layers, scheme)
    sub, s_sess, s_events = _decode(qm, False, monkeypatch)
    got, c_sess, c_events = _decode(qm, True, monkeypatch)
    for a, b in zip(sub, got):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    for a, b in zip(s_sess.k + s_sess.v, c_sess.k + c_sess.v):  # the KV cache each layer wrote, every position
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    n = qm.manifest["config"]["n_layers"]
    for s_ev, c_ev in zip(s_events, c_events):
        s_by, c_by = ({e["name"]: e for e in ev} for ev in (s_ev, c_ev))
        assert [e["name"] for e in s_ev] == [e["name"] for e in c_ev]
        for i in range(n):
            s, c = s_by[f"blk.{i}"], c_by[f"blk.{i}"]
            assert c.get("compiled_layer") is True and "compiled_layer" not in s
            assert c["flops"] == s["flops"] and c["fused_ops"] == s["fused_ops"] == 15
            assert set(c["parts_us"]) == set(decode_layer.PARTS) == set(s["parts_us"])
            assert all(v >= 0 for v in c["parts_us"].values()) and c["parts_us"]["linear"] > 0
            assert sum(c["parts_us"].values()) <= c["end_us"] - c["start_us"] + 1e-3  # shares of the time it ran
            assert (c["deps"], c["shape"], c["bytes_in"], c["bytes_out"], c["layer"], c["lane"]) == \
                (s["deps"], s["shape"], s["bytes_in"], s["bytes_out"], s["layer"], s["lane"])
            assert c["lane"] == ("npu" if scheme == "q4_0-tile" else "cpu")
        starts = [c_by[f"blk.{i}"]["start_us"] for i in range(n)]
        assert starts == sorted(starts) and all(c_by[f"blk.{i}"]["end_us"] <= c_by[f"blk.{i + 1}"]["start_us"] + 1e-3
                                                for i in range(n - 1))
    # 4 steps: one call for the step's layers, or one per layer where the step has one
    assert calls == ({"run": 0, "run_layers": 4} if n > 1 else {"run": 4, "run_layers": 0})


def test_runs_and_plans_the_compiled_call_cannot_take_go_the_sub_op_path(monkeypatch):
    qm = _w8a8()
    # two sequences a step: rows the compiled call does not take (the plan's attention has batch 2)
    sub, _, _ = _decode(qm, False, monkeypatch, steps=2, batch=2)
    got, _, events = _decode(qm, True, monkeypatch, steps=2, batch=2)
    assert all(np.array_equal(a, b) for a, b in zip(sub, got))
    assert not any(e.get("compiled_layer") for ev in events for e in ev)
    # a full KV session: the sub-op path's own error, not a write past the cache
    with pytest.raises(OpError, match="exceed the session's capacity"):
        _decode(qm, True, monkeypatch, steps=10, capacity=9)
    # mllm-NPU's shadow GEMMs are not in the compiled layer
    _, _, events = _decode(_w8a8(scheme="w8a8-shadow"), True, monkeypatch, steps=1)
    assert not any(e.get("compiled_layer") for ev in events for e in ev)


def test_q4_0_tile_layers_compile_on_the_npu_lane_in_runs_only(monkeypatch):
    """A q4_0-tile step's one layer, and a q4_0-tile step placed on the cpu lane (whose q4_0-tile linear is BLAS on
    the float32 weight, other bits than the npu lane's GEMV), go the sub-op path: its bits, no compiled event."""
    if decode_layer.layers_q4 is None:
        pytest.skip("this CPU has no F16C: q4_0-tile layers run op by op")
    one = _w8a8(layers=1, scheme="q4_0-tile")
    sub, _, _ = _decode(one, False, monkeypatch, steps=2)
    got, _, events = _decode(one, True, monkeypatch, steps=2)
    assert all(np.array_equal(a, b) for a, b in zip(sub, got))
    assert not any(e.get("compiled_layer") for ev in events for e in ev)
    qm = _w8a8(layers=2, scheme="q4_0-tile")
    real = prefill_plan

    def on_cpu(*a, **k):
        plan = real(*a, **k)
        if k.get("session") and a[1] == 1:
            plan = {**plan, "ops": [{**o, "lane": "cpu"} for o in plan["ops"]]}
            plan.pop("lane_order", None)
        return plan
    monkeypatch.setattr(__import__(__name__), "prefill_plan", on_cpu)
    sub, _, s_events = _decode(qm, False, monkeypatch, steps=2)
    got, _, events = _decode(qm, True, monkeypatch, steps=2)
    assert {e["lane"] for ev in events for e in ev} == {"cpu"}
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(sub, got))
    assert not any(e.get("compiled_layer") for ev in events for e in ev)


def test_match_takes_a_llama_w8a8_layer_and_nothing_else():
    qm = _w8a8()
    step = prefill_plan(qm.manifest, 1, session=True)["ops"][0]
    layer = next(s for s in step["attrs"]["ops"] if s["name"] == "blk.1")["attrs"]
    m = compiled.match(layer)
    assert m is not None and (m["H"], m["KV"], m["d"], m["D"], m["layer"]) == (4, 2, 8, 32, 1)
    assert m["args"] == {"x": 0, "n1": 1, "n2": 2}

    def changed(i, fn):
        a = copy.deepcopy(layer)
        fn(a["ops"][i])
        return compiled.match(a)

    assert changed(4, lambda s: s["attrs"].update(freq_factors=[1.0] * 4)) is None  # Llama 3's scaled RoPE
    assert changed(1, lambda s: s["attrs"]["rec"].update(scheme="w8a8-shadow")) is None
    assert changed(1, lambda s: s["attrs"]["rec"].update(shape=[32, 16])) is None
    assert changed(6, lambda s: s["attrs"].update(batch=2)) is None
    assert changed(6, lambda s: s["inputs"].reverse()) is None  # q, k, v in another order
    assert changed(8, lambda s: s["inputs"].__setitem__(0, {"arg": 2})) is None  # the residual from another arg
    assert changed(0, lambda s: s["attrs"].update(head_dim=8)) is None  # a per-head norm
    assert compiled.match({**layer, "ops": layer["ops"][:-1]}) is None
    assert changed(13, lambda s: s["attrs"]["rec"].update(scheme="q4_0-tile")) is None  # one scheme a layer


def test_match_takes_a_q4_0_tile_layer_with_its_siblings_columns():
    qm = _w8a8(scheme="q4_0-tile")
    step = prefill_plan(qm.manifest, 1, session=True)["ops"][0]
    layer = next(s for s in step["attrs"]["ops"] if s["name"] == "blk.1")["attrs"]
    m = compiled.match(layer)
    assert m is not None and m["scheme"] == "q4_0-tile" and (m["H"], m["KV"], m["d"], m["D"]) == (4, 2, 8, 32)
    # q (32 columns), k and v (16 each, padded to a tile of 32) side by side; gate's 40 padded to 64 before up's
    assert (m["ko"], m["vo"], m["uo"], m["F"]) == (32, 64, 64, 40)
