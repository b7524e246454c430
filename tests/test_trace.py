"""Traces written by edgeprobe open again (Trace.load of Chrome/Perfetto JSON), `edgeprobe trace show/import`, lane
labels that say what each lane's times are, and timelines whose bars are all drawn (checked on the figure's data)."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from edgeprobe.cli import main
from edgeprobe.errors import EdgeprobeError
from edgeprobe.foreign import load_foreign
from edgeprobe.foreign.align import align
from edgeprobe.trace import (
    EVENT_ARGS,
    LANE_LABEL,
    LANE_ORDER,
    MIN_BAR_FRACTION,
    Trace,
    chunk_color,
    kind_color,
    outline_color,
    write_chrome_json,
)

DATA = Path(__file__).parent / "data" / "foreign"
LFM2 = DATA / "chrome_json" / "lfm2_hexagon_v79.json"
HEX = DATA / "llamacpp_hexagon" / "issue18139_mul_mat.log"
LFM2_CONFIG = dict(arch="lfm2", n_layers=16, hidden=2048, ffn=8192, n_heads=32, n_kv_heads=8, head_dim=64,
                   vocab_size=65536, qk_norm=True)


def _tiny_llm():
    """The e2e tests' random 2-layer Llama (hidden 16): a prefill on a local agent takes milliseconds."""
    spec = importlib.util.spec_from_file_location("e2e_conftest", Path(__file__).parent / "e2e" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.tiny_llm(2, 7, "q4_0-tile")


@pytest.fixture(scope="module")
def agent(module_dir):
    """A local agent and the tiny model."""
    from edgeprobe.device import Device

    with Device.local(store=module_dir / "store") as dev:
        yield dev, _tiny_llm()


@pytest.fixture(scope="module")
def run(agent):
    """A real chunked prefill on a local agent (two chunks, out-of-order) and its schedule's predicted trace."""
    dev, qm = agent
    return dev.prefill_chunked(qm, np.arange(32, dtype=np.int32) % 64, chunk=16, scheduler="ooo",
                               cost_model="snapdragon-8gen3", progress=False)


# ---- every written trace opens again ---------------------------------------------------------------
def test_run_trace_round_trips_through_chrome_json(run, tmp_path):
    trace = run.trace
    path = trace.to_chrome_json(tmp_path / "run.json")
    back = Trace.load(path)
    assert len(back.events) == len(trace.events) and back.lanes == trace.lanes
    for a, b in zip(trace.events, back.events):
        assert (b["name"], b["lane"], b["kind"]) == (a["name"], a["lane"], a["kind"])
        assert b["start_us"] == pytest.approx(a["start_us"], abs=1e-5)
        # Chrome's dur is at least 1 ns: a zero-length event comes back 0.001 µs long
        assert b["end_us"] == pytest.approx(max(a["end_us"], a["start_us"] + 0.001), abs=1e-5)
        assert {k: b[k] for k in EVENT_ARGS if k in a} == {k: a[k] for k in EVENT_ARGS if k in a}
    assert back.meta["title"] == trace.meta["title"] and "edgeprobe_chrome" not in back.meta
    assert {l: back.lane_label(l) for l in back.lanes} == {l: trace.lane_label(l) for l in trace.lanes}
    assert back.groups().keys() == trace.groups().keys()  # so compare() matches a reloaded trace
    m, mb = trace.metrics(), back.metrics()
    assert mb["makespan_ms"] == pytest.approx(m["makespan_ms"], abs=1e-6)
    assert Trace.load(trace.save(tmp_path / "own.json")).events == trace.events  # its own format as before


def test_several_devices_in_one_file_need_a_process(run, tmp_path):
    pred = run.schedule.to_trace()
    path = write_chrome_json(tmp_path / "farm.json", {"agent": run.trace, "model": pred})
    with pytest.raises(EdgeprobeError, match="2 processes"):
        Trace.load(path)
    back = Trace.load(path, process="model")
    assert [e["name"] for e in back.events] == [e["name"] for e in pred.events]
    assert back.meta["cost_model"] == "snapdragon-8gen3"
    assert back.lane_label("npu") == "npu (modelled: snapdragon-8gen3)"
    with pytest.raises(EdgeprobeError, match="no process 'x'"):
        Trace.load(path, process="x")


def test_load_reads_other_tools_chrome_json_and_load_foreign_delegates():
    t = Trace.load(LFM2)  # not edgeprobe's: read by edgeprobe.foreign's Chrome JSON reader
    assert len(t.events) == 46 and all(e["measured"] is True for e in t.events)
    h = Trace.load_foreign(HEX)
    assert h.events == load_foreign(HEX).events and h.meta["source"]["format"] == "llamacpp-hexagon-op"


def test_imported_trace_round_trips(tmp_path):
    a = align(load_foreign(LFM2), LFM2_CONFIG).trace
    back = Trace.load(a.to_chrome_json(tmp_path / "a.json"))
    keys = ("measured", "cycles", "mhz", "tensors", "input_shapes", "dtypes", "template_ops", "unmatched", "group")
    for x, y in zip(a.events, back.events):
        assert (y["name"], y["kind"], y["lane"], y["start_us"], y["end_us"]) == \
            (x["name"], x["kind"], x["lane"], x["start_us"], x["end_us"])
        assert {k: y.get(k) for k in keys} == {k: x.get(k) for k in keys}
    assert back.lane_label("npu") == a.lane_label("npu") == f"npu (measured: {a.meta['source']['tool']})"


def test_not_a_trace_is_one_line(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(LFM2_CONFIG))
    with pytest.raises(EdgeprobeError) as exc:
        Trace.load(bad)
    assert str(bad) in str(exc.value) and "\n" not in str(exc.value)
    assert main(["trace", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgeprobe: error:") and err.count("\n") == 1


# ---- the command line -------------------------------------------------------------------------------
def test_trace_show_writes_the_offline_timeline(run, tmp_path, capsys):
    path = run.trace.to_chrome_json(tmp_path / "run.json")
    out = tmp_path / "t.html"
    assert main(["trace", "show", str(path), "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["events"] == len(run.trace.events) and doc["lane_labels"]["npu"] == "npu (emulated on CPU)"
    html = out.read_text()
    assert "plotly" in html and "<script src=\"http" not in html  # plotly.js inlined: opens offline
    assert run.trace.events[-1]["name"] in html and "colour by chunk" in html
    assert main(["trace", "show", str(path)]) == 0 and path.with_suffix(".html").is_file()


def test_trace_import_aligns_fits_and_the_fit_schedules(tmp_path, capsys):
    from edgeprobe import models
    from edgeprobe.foreign.fit import FittedCostModel, fit
    from edgeprobe.prepare import prepared
    from edgeprobe.schedule import cost_model
    from edgeprobe.schedule.predict import predicted_schedule

    cfg = tmp_path / "lfm2.json"
    cfg.write_text(json.dumps(LFM2_CONFIG))
    out, fitted = tmp_path / "imp", tmp_path / "phone.json"
    assert main(["trace", "import", str(LFM2), "--out", str(out), "--model", str(cfg), "--fit", str(fitted),
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = align(load_foreign(LFM2), LFM2_CONFIG)
    assert doc["aligned_share"] == want.share and doc["events"] == 46 and doc["format"] == "chrome-json"
    perf = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in perf) == 46 and (out / "timeline.html").is_file()
    assert Trace.load(out / "trace.json").events[0]["measured"] is True
    m = cost_model(str(fitted))  # the .json branch: a fitted model by its declared format
    assert isinstance(m, FittedCostModel) and m == fit(want, name="phone")
    assert main(["trace", "import", str(LFM2), "--out", str(out)]) == 0
    assert "aligned" not in capsys.readouterr().out
    assert main(["trace", "import", str(LFM2), "--out", str(out), "--fit", str(fitted)]) == 2  # --fit needs --model
    # `edgeprobe schedule --cost-model FITTED.json` predicts with it: the same makespan as scheduling by hand
    assert main(["schedule", "--prompt-len", "256", "--chunk", "128", "--cost-model", str(fitted), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    qm = prepared(models.load("smollm2-135m"), "w8a8-shadow")  # the model `schedule` plans, as `run` does
    _, sched = predicted_schedule(qm.manifest, 256, 128, "ooo", m)
    assert got["cost_model"] == "phone" and got["makespan_ms"] == sched.makespan_us / 1e3


def test_a_fitted_cost_model_plans_a_run_on_the_agent(agent, tmp_path):
    from edgeprobe.foreign.fit import fit
    from edgeprobe.models import ModelConfig
    from edgeprobe.schedule import chunk_graph, cost_model, schedule

    dev, qm = agent
    path = tmp_path / "phone.json"
    fit(align(load_foreign(LFM2), LFM2_CONFIG), name="phone").to_json(path)
    res = dev.prefill_chunked(qm, np.arange(32, dtype=np.int32) % 64, chunk=16, scheduler="ooo",
                              cost_model=str(path), progress=False)  # what `run --cost-model FITTED.json` passes
    graph = chunk_graph(ModelConfig(**qm.manifest["config"]), 32, 16, manifest=qm.manifest)  # as the run builds it
    want = schedule(graph, cost_model(str(path)), "ooo")
    assert res.schedule.slots == want.slots and res.schedule.cost_model.name == "phone"
    assert res.schedule.to_trace().lane_label("npu") == "npu (predicted: phone, fitted to measurements)"


# ---- honest lane labels ----------------------------------------------------------------------------
def test_lane_labels_say_what_the_times_are(run):
    assert {"hmx", "dma"} <= set(LANE_ORDER) and {"hmx", "dma"} <= set(LANE_LABEL)
    assert {"measured", "cycles", "mhz", "tensors", "input_shapes", "dtypes", "template_ops",
            "unmatched"} <= set(EVENT_ARGS)
    assert run.trace.lane_label("npu") == "npu (emulated on CPU)"  # the agent's npu lane: NPU semantics on this CPU
    pred = run.schedule.to_trace()
    assert {pred.lane_label(l) for l in pred.lanes} == {f"{l} (modelled: snapdragon-8gen3)" for l in pred.lanes}
    assert pred.provenance() == "predicted" and run.trace.provenance() == "emulated"
    hexa = load_foreign(HEX)
    assert hexa.lane_label("npu") == "npu (measured: llama.cpp ggml-hexagon)" and hexa.provenance() == "measured"
    ev = [{"name": "m", "kind": "MUL_MAT", "lane": "hmx", "start_us": 0.0, "end_us": 1.0, "measured": True}]
    assert Trace(ev, {"source": {"tool": "qnn"}}).lane_label("hmx") == "hmx (measured: qnn)"
    fitted = Trace([{**ev[0], "lane": "npu", "measured": False, "predicted": True, "modelled": False}],
                   {"predicted": True, "cost_model": "phone", "modelled": False})
    assert fitted.lane_label("npu") == "npu (predicted: phone, fitted to measurements)"


# ---- timelines a reader can trust -------------------------------------------------------------------
def _check_bars(fig, span_ms):
    for t in fig.data:
        assert min(t.x) >= MIN_BAR_FRACTION * span_ms * (1 - 1e-12)  # every bar drawn, however short
        assert t.marker.line.width >= 1 and t.marker.line.color == outline_color(t.marker.color)
        assert t.marker.line.color.lower() not in ("#ffffff", "white")


def _toggle(fig):
    (menu,) = fig.layout.updatemenus
    by_kind, by_chunk = menu.buttons
    assert (by_kind.label, by_chunk.label) == ("colour by kind", "colour by chunk")
    vis_k, vis_c = by_kind.args[0]["visible"], by_chunk.args[0]["visible"]
    assert len(vis_k) == len(fig.data) and [not v for v in vis_k] == list(vis_c)
    assert [bool(t.visible) for t in fig.data] == list(vis_k)  # drawn by kind first; the legend lists only those
    return [t for t, v in zip(fig.data, vis_k) if v], [t for t, v in zip(fig.data, vis_c) if v]


def test_timeline_bars_visible_outlined_and_coloured_by_kind_or_chunk(run):
    ev = [dict(e) for e in run.trace.events]
    ev.append({**ev[-1], "name": "blip", "kind": "add", "end_us": ev[-1]["start_us"] + 0.01})  # a 10 ns op
    trace = Trace(ev, run.trace.meta)
    fig = trace.figure()
    t0 = min(e["start_us"] for e in ev)
    span_ms = (max(e["end_us"] for e in ev) - t0) / 1e3
    _check_bars(fig, span_ms)
    kinds, chunks = _toggle(fig)
    assert [t.name for t in kinds] == sorted({e["kind"] for e in ev})
    assert [t.marker.color for t in kinds] == [kind_color(t.name) for t in kinds]
    # flash reads belong to no chunk: drawn in grey, listed last
    assert [t.name for t in chunks] == ["chunk 0", "chunk 1", "no chunk"]
    assert [t.marker.color for t in chunks] == [chunk_color(0), chunk_color(1), chunk_color(None)]
    assert sum(len(t.x) for t in kinds) == sum(len(t.x) for t in chunks) == len(ev)
    blip = next(t for t in kinds if "blip" in [c[0] for c in t.customdata])
    i = [c[0] for c in blip.customdata].index("blip")
    assert blip.x[i] == MIN_BAR_FRACTION * span_ms  # drawn at the minimum width; its hover gives the real time
    assert blip.customdata[i][5] == (ev[-1]["end_us"] - ev[-1]["start_us"]) / 1e3 < 1e-4
    labels = set(fig.layout.yaxis.categoryarray)
    assert labels == {trace.lane_label(l) for l in trace.lanes} and "npu (emulated on CPU)" in labels


def test_colouring_chosen_is_kept(run):
    from edgeprobe.trace import colouring, set_colouring

    fig = run.trace.figure()
    assert colouring(fig) == "kind"
    set_colouring(fig, "chunk")  # as the button does: the chunk traces shown, the kind traces hidden
    by_chunk = fig.layout.updatemenus[0].buttons[1].args[0]["visible"]
    assert [t.visible for t in fig.data] == list(by_chunk) and fig.layout.updatemenus[0].active == 1
    assert colouring(fig) == "chunk" and fig.layout.legend.title.text == "chunk"
    again = set_colouring(run.trace.figure(), colouring(fig))  # what the notebook panel does on a re-run
    assert [t.visible for t in again.data] == list(by_chunk)
    assert colouring(set_colouring(again, "kind")) == "kind"


def test_compare_draws_both_sides_visible_with_the_toggle(run):
    pred = run.schedule.to_trace()
    fig, rows = run.trace.compare(pred)
    assert rows and all(r["measured_ms"] > 0 for r in rows)
    spans = [(max(v[2] for v in t.groups().values()) - min(v[1] for v in t.groups().values())) / 1e3
             for t in (run.trace, pred)]
    _check_bars(fig, max(spans))
    kinds, chunks = _toggle(fig)
    assert {t.name for t in chunks} == {"chunk 0", "chunk 1"} and {"ffn", "attn"} <= {t.name for t in kinds}
    ys = {y for t in fig.data for y in t.y}
    assert "npu (modelled: snapdragon-8gen3) · predicted" in ys and "npu (emulated on CPU) · measured" in ys


def test_prediction_scatter_per_group_with_the_identity_line(run):
    pred = run.schedule.to_trace()
    fig, rows = run.trace.prediction_scatter(pred)
    ident, *points = fig.data
    assert ident.x == ident.y and ident.mode == "lines"
    assert sorted(zip((x for t in points for x in t.x), (y for t in points for y in t.y))) == \
        sorted((r["measured_ms"], r["predicted_ms"]) for r in rows)
    assert ident.x[0] <= min(min(t.x + t.y) for t in points) and ident.x[1] >= max(max(t.x + t.y) for t in points)
    assert {t.name for t in points} == {run.trace.lane_label(r["lane"]) for r in rows}
