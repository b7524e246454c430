"""A linear record names its recipe in `scheme`; records saved before the rename name it `kind`. Manifests, plans
and wire messages are contracts: an old record loads and computes the same bits on the host and on the agent."""
import json
import shutil

import numpy as np
import pytest
from test_graph import toy_model

from edgeprobe.quant import QuantizedModel, calibration_profile, quantize
from edgeprobe_agent.executor import Context, execute, validate
from edgeprobe_agent.ops import OpError
from edgeprobe_kernels.linear_records import scheme_of

SCHEMES = ["w8a8-shadow", "w8a8c-shadow", "llm-int8", "q4_0", "q4_0-tile", "float"]


@pytest.fixture(scope="module")
def models():
    m = toy_model(layers=2, hidden=32, heads=4, kv=2, ffn=40, seed=5)
    ids = np.random.default_rng(4).integers(0, m.config.vocab_size, 256)
    prof = calibration_profile(m, ids, tokens=256, window=64, progress=False)
    return {s: quantize(m, s, prof, prune_rate=0.5) for s in SCHEMES}, ids


def _old(rec: dict) -> dict:
    """The record as an agent or manifest before the rename held it: `kind`, no `scheme`."""
    out = {k: v for k, v in rec.items() if k != "scheme"}
    out["kind"] = rec["scheme"]
    return out


def _new(rec: dict) -> dict:
    """The record with `scheme` alone."""
    return {k: v for k, v in rec.items() if k != "kind"}


def test_scheme_of_reads_either_field():
    assert scheme_of({"scheme": "w8a8"}) == "w8a8" and scheme_of({"kind": "q4_0"}) == "q4_0"
    assert scheme_of({"scheme": "w8a8", "kind": "w8a8"}) == "w8a8" and scheme_of({}) is None


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_old_manifest_loads_and_computes_the_same_bits(models, scheme, tmp_path):
    qms, ids = models
    qm = qms[scheme]
    assert all(rec["scheme"] == scheme for n, rec in qm.manifest["linears"].items() if "ffn_gate_inp" not in n)
    qm.save(tmp_path / "new")
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    path = tmp_path / "old" / "manifest.json"
    man = json.loads(path.read_text())
    man["linears"] = {n: _old(rec) for n, rec in man["linears"].items()}
    if man.get("head"):
        man["head"] = _old(man["head"])
    path.write_text(json.dumps(man))
    old, new = QuantizedModel.load(tmp_path / "old"), QuantizedModel.load(tmp_path / "new")
    assert all("scheme" not in rec for rec in old.manifest["linears"].values())
    np.testing.assert_array_equal(old.forward(ids[:12]), new.forward(ids[:12]))


def _run(ops: list, x: np.ndarray, get) -> np.ndarray:
    plan = validate({"ops": ops, "outputs": [ops[-1]["name"]]}, has_blob=lambda s: True)
    out, _ = execute(plan, {"x": x}, Context(get=get))
    return out[ops[-1]["name"]]


@pytest.mark.parametrize("lane", ["cpu", "npu"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_agent_runs_a_linear_record_of_either_format_to_the_same_bits(models, scheme, lane):
    qm = models[0][scheme]
    rec = qm.manifest["linears"]["blk.1.attn_q"]
    x = np.random.default_rng(1).standard_normal((5, rec["shape"][1])).astype(np.float32) * 3
    ys = [_run([{"name": "y", "kind": "linear", "lane": lane, "inputs": [{"input": "x"}], "attrs": {"rec": r}}], x,
               qm.store.get) for r in (_old(rec), _new(rec), rec)]
    np.testing.assert_array_equal(ys[0], ys[1])
    np.testing.assert_array_equal(ys[0], ys[2])


@pytest.mark.parametrize("scheme", ["w8a8-shadow", "w8a8c-shadow"])
def test_a_fused_step_groups_old_and_new_sibling_linears_alike(models, scheme):
    """q, k, v read one input: a fused op computes W8A8 siblings in one kernel call (ops.linear.group_linear),
    whichever field their records name the scheme in."""
    qm = models[0][scheme]
    L = qm.manifest["linears"]
    x = np.random.default_rng(2).standard_normal((1, 32)).astype(np.float32) * 3

    def fused(form):
        subs = [{"name": p, "kind": "linear", "inputs": [{"arg": 0}], "attrs": {"rec": form(L[f"blk.0.{p}"])}}
                for p in ("attn_q", "attn_k", "attn_v")]
        subs.append({"name": "qk", "kind": "concat", "inputs": [{"op": "attn_q"}, {"op": "attn_k"}, {"op": "attn_v"}],
                     "attrs": {"axis": 1}})
        return [{"name": "f", "kind": "fused", "lane": "cpu", "inputs": [{"input": "x"}], "attrs": {"ops": subs}}]
    old, new = _run(fused(_old), x, qm.store.get), _run(fused(_new), x, qm.store.get)
    np.testing.assert_array_equal(old, new)
    one = np.concatenate([qm.linear(f"blk.0.{p}", x) for p in ("attn_q", "attn_k", "attn_v")], axis=1)
    np.testing.assert_array_equal(old, one)


def test_a_record_of_an_unknown_scheme_is_refused_by_name(models):
    rec = {**models[0]["float"].manifest["linears"]["blk.0.attn_q"], "scheme": "w3a3"}
    x = np.ones((1, 32), np.float32)
    with pytest.raises(OpError, match="scheme 'w3a3' is unknown") as e:
        _run([{"name": "y", "kind": "linear", "lane": "cpu", "inputs": [{"input": "x"}], "attrs": {"rec": rec}}], x,
             models[0]["float"].store.get)
    assert e.value.code == "unknown_record"
