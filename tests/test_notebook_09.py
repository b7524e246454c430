"""Notebook 09 (plan a phone you do not have) executes for real in a Jupyter kernel, and its headline numbers are
recomputed here from the same configs and SoC file by edgeprobe.schedule.predict and schedule.papers, the functions
`edgeprobe predict` and bench/papers.py call: what the notebook says is what the command gives."""
import json
import re
from pathlib import Path

import pytest
from test_notebooks import _conclusion, execute_notebook

from edgeprobe.schedule import papers
from edgeprobe.schedule.predict import predict

NAME = "09_plan_a_phone"
CONFIGS = Path(__file__).parent / "data" / "configs"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb, results = execute_notebook(NAME, tmp_path_factory.mktemp("nb09"))
    return nb, json.loads((results / f"{NAME}.json").read_text())


def test_notebook_09_executes_and_draws_five_figures(executed):
    nb, _ = executed
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) == 5 and all(f["data"]["application/vnd.plotly.v1+json"]["data"] for f in figures)


def test_notebook_09_headline_numbers_are_the_commands(executed):
    nb, r = executed
    model = CONFIGS / r["model"] / "config.json"
    for strategy, got in r["ways"].items():
        want = predict(model, r["soc"], r["prompt"], r["decode"], scheme=got["scheme"], strategy=strategy).to_json()
        assert got["prefill_tok_s"] == want["prefill_tok_s"] and got["decode_tok_s"] == want["decode_tok_s"]
    b1 = predict(CONFIGS / "llama-3.2-1b" / "config.json", r["soc"], 512, 128, batch=16, scheme="q4_0-tile",
                 strategy="npu")
    assert r["batched"]["16"] == b1.decode_tok_s_batch and r["batched"]["16"] > 4 * r["batched"]["1"]
    for m, s in r["split"].items():  # HeteroLLM's split: above one processor, below the bandwidth ratio 59.1 / 43.3
        assert 1.0 < s["hetero"] / s["gpu"] < 59.1 / 43.3
    moe = [r["moe"][h] for h in sorted(r["moe"], key=float)]
    assert moe == sorted(moe)  # a higher hit rate never slows a step
    assert r["summary"] == json.loads(json.dumps(papers.summary(papers.check())))
    text = _conclusion(nb)
    assert f"median |error|\n  **{r['summary']['median_abs_error']:.0%}**" in text
    assert re.search(rf"split\s+gives {r['ways']['hetero']['decode_tok_s']:.1f} tok/s", text)
