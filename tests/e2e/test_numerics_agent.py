"""Numerics op by op on a real local agent (issue 41): SmolLM2 under w8a8, a 16-token prefill with every op captured,
compared with the host's simulation and the float model; a seeded one-code fault in one op is found by name."""
import numpy as np
import pytest

from edgeprobe.device import Device, DeviceError
from edgeprobe.numerics import NumericsError, prefill_numerics


@pytest.fixture(scope="module")
def qm(smollm):
    from edgeprobe.prepare import prepared

    return prepared(smollm, "w8a8", progress=False)


@pytest.fixture(scope="module")
def tokens(heldout_ids):
    return np.asarray(heldout_ids[:16], np.int32)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    d = Device.local(store=tmp_path_factory.mktemp("numerics-store"))
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
    r = subprocess.run(base + ["--numerics", "--numerics-ops", "blk.0.*,lm_head", "--numerics-out", str(tmp_path / "n"),
                               "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    nm = json.loads(r.stdout.strip().splitlines()[-1])["numerics"]
    assert nm["ops"] == 16 and nm["first_divergent"] is None and nm["capture_ms"] > 0
    saved = json.loads((tmp_path / "n" / "numerics.json").read_text())
    assert [o["op"] for o in saved["ops"]][-1] == "lm_head" and (tmp_path / "n" / "numerics.html").stat().st_size
