"""One story for predictions: `schedule` and `run --cost-model X` predict the same makespan for the same model,
scheme, prompt length, chunk and scheduler, each --help names its default cost model, and the JSON says which."""
import json
from types import SimpleNamespace

import pytest

from edgeprobe import models
from edgeprobe.cli import build_parser, main
from edgeprobe.prepare import prepared

CALIB = 128  # a short calibration keeps the test quick; both sides read the same prepared model


@pytest.fixture(scope="module")
def smol():
    return models.load("smollm2-135m")


class _PlanningAgent:
    """What workflows.prefill_chunked (run's chunked prefill) needs of an agent, to read the prediction it makes;
    nothing is executed."""

    info = {"lanes": ["cpu", "npu", "gpu"]}

    def upload(self, qm, progress=False):
        return 0

    def load_model(self, qm):
        pass

    def put_plan(self, plan):
        self.plan = plan
        return "plan"

    def run(self, plan_id, inputs, title=""):
        return SimpleNamespace(trace=SimpleNamespace(meta={}))


def _run_prediction(qm, n, chunk, scheduler, cost_name):
    from edgeprobe.workflows import prefill_chunked

    res = prefill_chunked(_PlanningAgent(), qm, list(range(100, 100 + n)), chunk=chunk, scheduler=scheduler,
                          cost_model=cost_name, progress=False)
    return res.trace.meta["predicted_makespan_ms"]


@pytest.mark.parametrize("cost_name,scheduler,n,chunk", [("snapdragon-8gen3", "ooo", 1024, 256),
                                                          ("this-host-emulated", "in-order", 512, 128),
                                                          ("snapdragon-8gen3", "ooo", 300, 512)])
def test_schedule_and_run_predict_the_same_makespan(smol, tmp_path, monkeypatch, capsys, cost_name, scheduler, n,
                                                    chunk):
    import edgeprobe.cli.schedule as sched_cli

    monkeypatch.setenv("EDGEPROBE_PREPARED_CACHE", str(tmp_path))
    monkeypatch.setattr(sched_cli, "prepared_model",
                        lambda model, scheme, progress, say=None: prepared(model, scheme, calib_tokens=CALIB))
    qm = prepared(smol, "w8a8-shadow", calib_tokens=CALIB)
    assert main(["schedule", "--prompt-len", str(n), "--chunk", str(chunk), "--scheduler", scheduler,
                 "--cost-model", cost_name, "--scheme", "w8a8-shadow", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cost_model"] == cost_name and out["scheme"] == "w8a8-shadow"
    # run clamps a chunk longer than the prompt to the prompt, and so does schedule
    assert out["makespan_ms"] == _run_prediction(qm, n, min(chunk, n), scheduler, cost_name)


def test_schedule_graph_follows_the_scheme(smol, tmp_path, monkeypatch, capsys):
    """w8a8-shadow keeps shadow GEMMs in a few layers only; w8a8 has none: the two schedules differ."""
    import edgeprobe.cli.schedule as sched_cli

    monkeypatch.setenv("EDGEPROBE_PREPARED_CACHE", str(tmp_path))
    monkeypatch.setattr(sched_cli, "prepared_model",
                        lambda model, scheme, progress, say=None: prepared(model, scheme, calib_tokens=CALIB))
    got = {}
    for scheme in ("w8a8-shadow", "w8a8"):
        assert main(["schedule", "--prompt-len", "512", "--scheme", scheme, "--json", "--no-progress"]) == 0
        got[scheme] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert got[scheme]["makespan_ms"] == _run_prediction(prepared(smol, scheme, calib_tokens=CALIB), 512, 256,
                                                             "ooo", "snapdragon-8gen3")
    assert got["w8a8"]["subgraphs"] < got["w8a8-shadow"]["subgraphs"]


def test_each_command_names_its_default_cost_model_and_scheme():
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    acts = {cmd: {a.dest: a for a in sub.choices[cmd]._actions} for cmd in ("schedule", "run")}
    assert acts["schedule"]["cost_model"].default == "snapdragon-8gen3"  # the contracts stay
    assert acts["run"]["cost_model"].default == "this-host-emulated"
    assert acts["schedule"]["scheme"].default == acts["run"]["scheme"].default
    for cmd, acts_of in acts.items():
        text = acts_of["cost_model"].help
        assert f"Default {acts_of['cost_model'].default}" in text and "cost_model" in text, cmd
