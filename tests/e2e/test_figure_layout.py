"""Timelines as a person sees them in a narrow notebook or report column: drawn by real headless Chromium, the title
and subtitle lie inside the figure (nothing cut at its right edge) and the colour buttons cover neither. Boxes are
read from the drawn SVG (getBoundingClientRect), not from the layout's numbers."""
import json
import re

import pytest

from edgeprobe.browser import dump_dom
from edgeprobe.trace import Trace

WIDTH = 700  # a JupyterLab output column beside the file browser; the report's is 1200
GEOMETRY_JS = """
var gd = document.getElementById('{plot_id}');
function boxes(sel) { return Array.from(gd.querySelectorAll(sel)).map(function (e) {
  var r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; }); }
var pre = document.createElement('pre'); pre.id = 'geometry';
pre.textContent = JSON.stringify({figure: boxes('.main-svg')[0], title: boxes('.gtitle'),
                                  buttons: boxes('.updatemenu-button')});
document.body.appendChild(pre);
"""


def _trace(predicted: bool) -> Trace:
    lanes = ("npu", "cpu", "gpu", "io")
    ev = [{"name": f"c{c}.blk.{i}.{lane}", "kind": ("matmul", "attention", "rms_norm", "flash_read")[k],
           "lane": lane, "start_us": 1000.0 * (c * 8 + i), "end_us": 1000.0 * (c * 8 + i) + 700.0, "chunk": c,
           **({"predicted": True} if predicted else {"emulated": "semantics"} if lane == "npu" else {})}
          for k, lane in enumerate(lanes) for c in range(4) for i in range(8)]
    meta = ({"predicted": True, "cost_model": "snapdragon-8gen3", "modelled": True} if predicted else
            {"title": "measured"})
    return Trace(ev, meta)


def _geometry(fig, tmp_path, name):
    page = tmp_path / f"{name}.html"
    fig.update_layout(width=WIDTH)
    fig.write_html(str(page), include_plotlyjs=True, full_html=True, post_script=GEOMETRY_JS)
    found = re.search(r'<pre id="geometry">(.*?)</pre>', dump_dom(page))
    assert found, "the figure did not draw"
    return json.loads(found.group(1).replace("&quot;", '"'))


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.parametrize("which", ["measured", "predicted", "compare"])
def test_titles_are_whole_and_no_button_covers_them_in_a_narrow_column(which, tmp_path):
    long = ("measured on the agent: 1024-token prefill in 256-token chunks, out-of-order, w8a8-shadow, best of 2 "
            "runs")
    if which == "compare":
        fig, _ = _trace(False).compare(_trace(True), title=long)
    else:
        fig = _trace(which == "predicted").figure(long if which == "measured" else "predicted: out-of-order")
    g = _geometry(fig, tmp_path, which)
    left, _, right, _ = g["figure"]
    assert len(g["buttons"]) == 2 and g["title"]
    for t in g["title"]:
        assert left <= t[0] and t[2] <= right, f"title {t} cut by the figure's edges {left}..{right}"
        for b in g["buttons"]:
            assert not _overlap(t, b), f"button {b} covers the title {t}"
