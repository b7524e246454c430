"""A notebook executed by the ordinary route a user takes (`jupyter nbconvert --to html --execute`), with no plotly
setting of ours in the environment, exports figures that draw offline: checked in a real headless Chromium."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from edgeprobe.browser import dump_dom

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
SMALL = {"EDGEPROBE_NB_TOKENS": "512"}  # notebook 01 profiles 4 windows of 128 tokens: seconds, not minutes


def test_nbconvert_execute_exports_figures_that_draw_offline(tmp_path):
    shutil.copy(NOTEBOOKS / "01_outliers.ipynb", tmp_path)  # its cells write out/ next to it: not into the repo
    env = {k: v for k, v in os.environ.items() if k != "PLOTLY_RENDERER"}  # what a user has: nothing set
    env.update(SMALL, EDGEPROBE_NB_RESULTS=str(tmp_path / "results"))
    r = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", "--execute",
                        "--ExecutePreprocessor.timeout=600", "01_outliers.ipynb"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cannot be represented" not in r.stderr  # nbconvert's warning for a figure it had to drop
    page = tmp_path / "01_outliers.html"
    text = page.read_text()
    # plotly.js inline, once (4 MB): no network needed, and not a copy per figure
    assert not re.search(r'<script[^>]*src="[^"]*plot\.ly', text) and text.count("* plotly.js v") == 1
    dom = dump_dom(page)
    # the notebook shows 4 figures (Fig. 10, 11, 12 and the histogram): each drew its plot and SVG layers
    assert len(re.findall(r'class="[^"]*\bjs-plotly-plot\b', dom)) == 4, dom[:2000]
    assert dom.count('class="main-svg"') >= 4 and dom.count("<svg") >= 8
    # the conclusion, a Markdown output rendered from the computed numbers, is on the page as HTML: a list of findings
    results = json.loads((tmp_path / "results" / "01_outliers.json").read_text())
    found = re.search(r"<ul>(.*?)</ul>", dom[dom.index("What we found"):], re.S)
    assert found and found.group(1).count("<li>") == 4
    assert f"{results['outlier_channels_per_window_mean']:.1f} channels per layer" in found.group(1)
