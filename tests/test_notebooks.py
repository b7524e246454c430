"""The research notebooks execute for real, top to bottom, in a Jupyter kernel (small token budgets)."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["01_outliers.ipynb", "02_experts.ipynb", "03_sparsity.ipynb", "04_quantization.ipynb",
                                  "05_device_timeline.ipynb", "06_scheduling.ipynb", "07_decoding.ipynb"])
def test_notebook_executes_and_draws(name, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPROBE_NB_TOKENS", "1024")
    # figures carry plotly.js inline as text/html too, so an HTML export renders offline (checked in Chromium below)
    monkeypatch.setenv("PLOTLY_RENDERER", "plotly_mimetype+notebook")
    monkeypatch.setenv("EDGEPROBE_AGENT_STORE", str(tmp_path / "agent-store"))
    for k, v in {"EDGEPROBE_NB_WINDOW": "64", "EDGEPROBE_NB_WINDOWS": "2", "EDGEPROBE_NB_CALIB": "256",
                 "EDGEPROBE_NB_PROMPT": "32"}.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) >= 3
    assert "application/vnd.plotly.v1+json" in str(outputs)
    for f in figures:
        assert f["data"]["application/vnd.plotly.v1+json"]["data"], "an empty figure"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "paper" in text  # our numbers are printed beside the paper's
    assert nb.cells[0].source.startswith("# ") and "Question" in nb.cells[0].source
    assert "What we found" in nb.cells[-2].source or "What we found" in nb.cells[-1].source
    if name == "05_device_timeline.ipynb":  # the live panel: its controls and a timeline the sweep redrew in place
        state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"].values()
        models = [w["model_name"] for w in state]
        assert models.count("DropdownModel") >= 3 and "FloatSliderModel" in models and "ButtonModel" in models
        assert "AnyModel" in models  # plotly's FigureWidget; its redraws travel as deltas, so ask the kernel below
        shown = text[text.index("the panel now shows:"):].splitlines()[0]
        # after the sweep the panel shows its last setting (q4_0-tile, layer by layer), not the first run
        assert "q4_0-tile" in shown and "layer" in shown and "chunk" not in shown and not shown.endswith("(0 bars)")
    if name == "06_scheduling.ipynb":  # exported to HTML and looked at in a real headless Chromium
        from nbconvert import HTMLExporter

        from edgeprobe.browser import dump_dom

        body, _ = HTMLExporter().from_notebook_node(nb)
        page = tmp_path / "06.html"
        page.write_text(body)
        dom = dump_dom(page)
        assert dom.count('class="main-svg"') >= len(figures) and dom.count('class="trace bars"') >= 3
