"""Notebook 08 (a phone's trace beside our prediction) executes for real in a Jupyter kernel, as tests/test_notebooks.py
runs the others, and its headline numbers are recomputed here from the bundled trace: the aligned share from the
fixture's raw JSON, the held-out error by an independent least squares, the makespans from the saved cost model."""
import json

import numpy as np
import pytest
from test_foreign import LFM2, LFM2_CONFIG, _ref_fit, _ref_pred
from test_notebooks import _conclusion, execute_notebook

from edgeprobe.foreign import load_foreign
from edgeprobe.foreign.align import align
from edgeprobe.foreign.fit import load_cost_model
from edgeprobe.models import ModelConfig
from edgeprobe.models.config import plan_manifest
from edgeprobe.schedule.graph import chunk_graph
from edgeprobe.schedule.schedulers import schedule

NAME = "08_phone_trace"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb, results = execute_notebook(NAME, tmp_path_factory.mktemp("nb08"))
    return nb, json.loads((results / f"{NAME}.json").read_text()), results


def test_notebook_08_executes_and_draws(executed):
    nb, r, _ = executed
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) == 5 and all(f["data"]["application/vnd.plotly.v1+json"]["data"] for f in figures)
    assert r["fixture"] == LFM2.name and r["events"] == 46 and r["skipped_events"] == 6 and r["tokens"] == 2


def test_notebook_08_aligned_share_from_the_raw_trace(executed):
    _, r, _ = executed
    raw = [e for e in json.loads(LFM2.read_text())["traceEvents"] if e["ph"] == "X"]
    assert r["total_us"] == sum(e["dur"] for e in raw) == 2819
    a = align(load_foreign(LFM2), LFM2_CONFIG)
    assert r["aligned_us"] == a.matched_us and r["aligned_share"] == a.matched_us / sum(e["dur"] for e in raw)
    # the kinds left unmatched are LFM2's convolution state and bookkeeping, never a matmul of the template's weights
    matched = {e["kind"] for e in a.trace.events if e.get("template_ops")}
    assert matched == {"RMS_NORM+MUL", "MUL_MAT+MUL_MAT", "SWIGLU", "MUL_MAT+ADD", "MUL_MAT+MUL_MAT+MUL_MAT", "ROPE",
                       "FLASH_ATTN_EXT"}


def test_notebook_08_held_out_error_recomputed_independently(executed):
    _, r, _ = executed
    samples = align(load_foreign(LFM2), LFM2_CONFIG).samples()
    train = [s for s in samples if s["layer"] in (0, 2)]
    errs, w = [], []
    for s in (s for s in samples if s["layer"] == 1):
        same = [t for t in train if (t["lane"], t["kind"]) == (s["lane"], s["kind"])]
        c = _ref_fit([t["flops"] for t in same], [t["us"] for t in same], [t["bytes"] for t in same])
        errs.append(abs(_ref_pred(c, s) - s["us"]) / s["us"])
        w.append(s["us"])
    h = r["held_out"]
    assert h["n_predicted"] == len(errs) == 5
    assert h["median_rel_error"] == pytest.approx(np.median(errs), rel=1e-9)
    assert h["time_weighted_rel_error"] == pytest.approx(np.average(errs, weights=w), rel=1e-9)
    assert h["max_rel_error"] == pytest.approx(max(errs), rel=1e-9)


def test_notebook_08_makespans_from_the_saved_cost_model(executed):
    _, r, out = executed
    phone = load_cost_model(out / "lfm2-sm8750.json")
    # the notebook plans the config-only model with float stand-ins; one regime per kind and no bytes term (one M in
    # the trace), so the subgraph-level pricing (no op binding) gives the same times
    cfg = ModelConfig(**LFM2_CONFIG)
    graph = chunk_graph(cfg, r["prompt"], r["chunk"], manifest=plan_manifest(cfg, "float"))
    assert all("below" not in f and f["us_per_byte"] == 0 for f in phone.fits["npu"].values())
    for s in ("in-order", "ooo"):
        assert r["makespan_ms"][f"lfm2-sm8750/{s}"] == pytest.approx(schedule(graph, phone, s).makespan_us / 1e3,
                                                                     rel=1e-12)
    # out of order never loses to in order on the same graph and costs (mllm-NPU §3.4)
    assert r["makespan_ms"]["lfm2-sm8750/ooo"] <= r["makespan_ms"]["lfm2-sm8750/in-order"]
    assert r["makespan_ms"]["snapdragon-8gen3/ooo"] <= r["makespan_ms"]["snapdragon-8gen3/in-order"]
    # compare's rows: one per aligned event, measured as the trace printed it
    a = align(load_foreign(LFM2), LFM2_CONFIG)
    assert sorted(x["measured_ms"] for x in r["compare_rows"]) == sorted(
        (e["end_us"] - e["start_us"]) / 1e3 for e in a.trace.events if e.get("template_ops"))


def test_notebook_08_conclusion_says_the_computed_numbers(executed):
    nb, r, _ = executed
    found = _conclusion(nb)
    mk = r["makespan_ms"]
    says = [f"**{r['aligned_share']:.1%} of the measured time**",
            f"**median error of {r['held_out']['median_rel_error']:.0%}**",
            f"{mk['lfm2-sm8750/ooo']:.0f} ms against in order {mk['lfm2-sm8750/in-order']:.0f} ms"]
    assert not [s for s in says if s not in found], found
