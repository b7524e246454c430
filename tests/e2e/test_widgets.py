"""The notebook's live timeline panel, driven from code against a real local agent."""
import numpy as np
import pytest

from edgeprobe import Device, models
from edgeprobe.corpus import read_corpus
from edgeprobe.quant import calibration_profile
from edgeprobe.widgets import TimelineExplorer


@pytest.fixture(scope="module")
def setup(module_dir):
    model = models.load("smollm2-135m")
    prompt = model.tokenizer.encode(read_corpus("heldout"))[:32]
    calib = calibration_profile(model, model.tokenizer.encode(read_corpus("train")), tokens=128, window=128)
    with Device.local(store=module_dir / "store") as dev:
        yield dev, model, prompt, calib


def _op_names(fig):
    return {c[0] for t in fig.data for c in t.customdata}


def test_controls_rerun_on_the_agent_and_redraw_in_place(setup):
    dev, model, prompt, calib = setup
    ex = TimelineExplorer(dev, model, prompt, calib, scheduler="in-order")
    fig = ex.figure
    first = _op_names(fig)
    assert ex.history[-1]["chunk"] == 32 and "c0.l0.attn_q" in first and ex.history[-1]["cosine_vs_host"] > 0.999
    assert not [n for n in first if n.startswith("c1.")]
    res = ex.set(chunk=16).run()  # two chunks now: each layer's subgraphs appear twice
    assert ex.figure is fig and res is ex.result  # the same widget, its traces swapped
    assert [n for n in _op_names(fig) if n.startswith("c1.")] and "chunk 16" in fig.layout.title.text
    assert ex.history[-1]["predicted_makespan_ms"] > 0 and ex.history[-1]["cosine_vs_host"] > 0.999
    assert ex.history[-1]["makespan_ms"] == pytest.approx(res.trace.metrics()["makespan_ms"])  # the run drawn
    ex.set(scheduler="layer", scheme="q4_0-tile").run()
    assert ex.controls["chunk"].disabled and ex.controls["prune_rate"].disabled  # ignored by this setting, greyed out
    # the layer plan is predicted too (its ops as one chunk, in order), and every row carries predicted / measured
    assert all(h["predicted_over_measured"] == pytest.approx(h["predicted_makespan_ms"] / h["makespan_ms"])
               for h in ex.history)
    assert "q4_0-tile" in fig.layout.title.text and "chunk" not in fig.layout.title.text
    # the prune rate changes what the agent computes: fewer shadow outliers at a higher rate
    ex.set(scheme="w8a8-shadow", scheduler="layer", prune_rate=0.0).run()
    kept = ex.result.counters.get("outliers", 0)
    ex.set(prune_rate=1.0).run()
    assert ex.result.counters.get("outliers", 0) < kept
    assert len(ex.history) == 5 and len({(h["scheme"], h["prune_rate"]) for h in ex.history}) >= 3


def test_bad_settings_say_what_to_do_and_the_panel_survives(setup):
    dev, model, prompt, calib = setup
    ex = TimelineExplorer(dev, model, prompt, calib=None, scheme="w8a8", run=False)
    with pytest.raises(ValueError, match="chunk=999 is not offered"):
        ex.set(chunk=999)
    with pytest.raises(ValueError, match="unknown control 'lanes'"):
        ex.set(lanes=2)
    with pytest.raises(ValueError, match=r"outside \[0.0, 1.0\]"):
        ex.set(prune_rate=1.5)
    with pytest.raises(ValueError, match="calibration profile"):  # from code: raised
        ex.run()
    ex.button.click()  # from the button: shown in the panel, not raised into the widget event loop
    assert "calibration profile" in ex.status.value and not ex.button.disabled and ex.result is None
    ex.set(scheme="float", scheduler="ooo")
    ex.button.click()
    assert ex.result is not None and "makespan" in ex.status.value
    with pytest.raises(ValueError, match="scheduler='fifo' is not offered"):
        TimelineExplorer(dev, model, prompt, calib, scheduler="fifo", run=False)
    with pytest.raises(ValueError, match="at least 16"):
        TimelineExplorer(dev, model, np.arange(8), calib)


def test_the_panel_runs_after_a_later_cell_closed_its_device(setup, tmp_path):
    """Notebook 05 after Run All: its last cell closed the device, then the user presses Run on the agent."""
    import zmq

    from edgeprobe.widgets import _sentence

    _, model, prompt, _ = setup
    dev = Device.local(store=tmp_path / "store")
    ex = TimelineExplorer(dev, model, prompt, scheme="q4_0-tile", scheduler="layer", check_host=False, run=False)
    dev.close()
    ex.button.click()
    assert ex.result is not None, ex.status.value
    assert ex.history[-1]["makespan_ms"] == pytest.approx(ex.result.trace.metrics()["makespan_ms"])
    assert ex.history[-1]["makespan_ms"] > 0
    own = ex.dev  # a local agent of the panel's own, on the closed one's flash: no new upload
    assert own is not dev and not own.closed and own.store == dev.store and own.process.poll() is None
    ex.button.click()  # the panel's own agent serves the next press too: no other agent started
    assert len(ex.history) == 2 and ex.dev is own and not own.closed
    assert ex.snapshot().data and ex.snapshot().layout.title.text == ex.figure.layout.title.text  # for exported pages
    ex.close()
    assert ex.dev.closed
    # a connection failure reads as a sentence with what to do, never ZeroMQ's own words
    text = _sentence(zmq.ZMQError(zmq.ENOTSOCK))
    assert "ZMQError" not in text and "Run the cell that opens the device again" in text
    # the button keeps its whole label: it never shrinks for the status line beside it
    assert ex.button.layout.flex == "0 0 auto" and ex.button.layout.min_width == "max-content"
