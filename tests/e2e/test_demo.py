"""The main job end to end, small: profile, quantize, schedule, run on a local agent, report — then the report
looked at in a real headless Chromium (the plotly charts drew their SVG layers) and a second run from caches."""
import json
import subprocess
import sys

import numpy as np
import pytest

from edgeprobe.browser import dump_dom, screenshot
from edgeprobe.demo import DemoError, run_demo


def test_demo_writes_a_report_that_renders_in_chromium_and_reruns_from_caches(tmp_path):
    out = tmp_path / "out"
    lines = []
    # best of 5 alternating runs per scheduler: a 128-token prefill takes ~0.6 s, one run swings by +-15%, and the
    # gain of reordering two chunks is small (0.89-0.99x seen), so the minimum of a few runs is what compares
    kw = dict(out=out, prompt_len=128, chunk=64, profile_tokens=1024, eval_windows=1, accuracy_windows=1, repeats=5,
              progress=False, print_fn=lines.append)
    s = run_demo(**kw)
    print("\ndemo summary:", json.dumps({k: v for k, v in s.items() if k not in ("report", "trace", "timeline")}))
    # mllm-NPU §3.4's mechanism: out-of-order fills the emulated NPU's bubbles (idle 67-87 ms in-order, 25-39 ms
    # out-of-order seen) ...
    idle = {k: s[f"{k}_ms"] * (1 - s[f"busy_pct_{k}"]["npu"] / 100) for k in ("in_order", "ooo")}
    assert idle["ooo"] < 0.75 * idle["in_order"]
    # ... which on a phone's separate NPU and CPU is the makespan gain. Here both lanes share two x86 cores, and the
    # overlap out-of-order adds slows the NPU lane's own ops by ~20% (busy time 1.69 -> 2.08 s at 512/128): measured
    # 0.95-1.03x on a quiet machine, 1.17x beside two CPU-bound processes and another test suite. The measured
    # makespan is therefore reported, not ordered; a scheduler that left the NPU waiting fails the idle check above
    assert s["ooo_vs_in_order"] == pytest.approx(s["ooo_ms"] / s["in_order_ms"], abs=2e-3)
    # ... as the heuristic predicted on the agent-measured cost model (0.86-0.89x seen); a greedy list schedule predicted
    # slower than program order would make the measured gain luck
    assert 0 < s["predicted_ooo_ms"] < s["predicted_in_order_ms"]
    assert all(0 < v <= 100 for v in s["busy_pct_ooo"].values()) and s["busy_pct_ooo"]["npu"] > 0
    # 2 chunks: static subgraphs are built once instead of twice, so at most half of the per-chunk memory is saved
    assert 0 < s["chunk_shared_memory_saving"] < 1 - 1 / 2
    acc = {k: v["perplexity"] for k, v in s["accuracy"].items()}
    assert set(acc) == {"float", "w8a8", "w8a8-shadow", "w8a8c-shadow", "q4_0-tile"}
    # the float row recomputed here from the same 256 held-out tokens (rounded to 3 decimals in the summary)
    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.evaluate import window_nll
    from edgeprobe.forward import forward

    m = models.load("smollm2-135m")
    held = m.tokenizer.encode(read_corpus("heldout"))
    ids = held[:256]
    assert acc["float"] == pytest.approx(float(np.exp(window_nll(forward(m, ids), ids).mean())), abs=2e-3)
    ids = held[:512]  # the held-out perplexity: one window of 512 (eval_windows=1)
    assert s["perplexity_heldout"] == pytest.approx(float(np.exp(window_nll(forward(m, ids), ids).mean())), abs=2e-3)
    # mllm-NPU Table 5's order: shadow outliers repair most of what per-tensor W8A8 loses; nothing beats float
    assert acc["float"] < acc["w8a8-shadow"] < acc["w8a8"] and acc["float"] < acc["q4_0-tile"]
    # per-channel weight scales and p99.1 clips with every outlier in float: near float (+0.6% over 8 x 256 seen)
    assert acc["w8a8c-shadow"] < min(acc["w8a8-shadow"], 1.05 * acc["float"])
    assert all(v["delta_vs_float_pct"] == pytest.approx(100 * (acc[k] / acc["float"] - 1), abs=0.02)
               for k, v in s["accuracy"].items())
    # outliers touch a few channels (mllm-NPU Fig. 10: 0.1-0.3%; SmolLM2's narrow layers ~1%), concentrated (Fig. 11)
    assert 0 < s["outlier_channels_pct"] < 5 and 0 < s["channels_for_80pct_outliers_pct"] < 5
    assert 0.02 < s["ffn_inactive_fraction"] < 0.6  # SiLU at 1% FFN error: about a fifth inactive, never ReLU's >90%
    assert any("summary" in line for line in lines)
    trace = json.loads((out / "trace.json").read_text())
    assert {e["ph"] for e in trace["traceEvents"]} >= {"X", "M"}  # Perfetto: complete events, named tracks
    assert json.loads((out / "summary.json").read_text())["ooo_ms"] == s["ooo_ms"]
    dom = dump_dom(out / "report.html")
    assert dom.count("js-plotly-plot") >= 8  # every figure became a plotly chart ...
    assert dom.count('class="main-svg"') >= 8 and dom.count('class="trace bars"') >= 8  # ... and drew its bars
    assert dom.count('class="point"') > 100
    png = screenshot(out / "timeline.html", tmp_path / "timeline.png")
    assert png.stat().st_size > 10_000  # ... and the timeline drew something, not a blank page
    again = []  # the reruns only have to finish (from caches; elsewhere): one run per scheduler
    s2 = run_demo(**{**kw, "print_fn": again.append, "repeats": 1})
    assert any("(cached)" in line for line in again) and any("cost model cached" in line for line in again)
    assert s2["seconds"] < s["seconds"]
    # a second demo while an agent (say, of an interrupted first one) still holds the store: it goes on, elsewhere
    from edgeprobe.device import Device, DeviceError

    with Device.local(store=out / ".cache" / "agent-store") as holder:
        with pytest.raises(DeviceError, match="in use by another agent"):
            Device.local(store=out / ".cache" / "agent-store")
        third = []
        s3 = run_demo(**{**kw, "print_fn": third.append, "repeats": 1})
        assert any("held by another agent" in line for line in third) and s3["ooo_ms"] > 0
        assert holder.hello()["agent_version"]


def test_demo_refuses_an_unwritable_or_full_place_clearly(tmp_path, monkeypatch):
    import shutil

    from edgeprobe import demo

    monkeypatch.setattr(demo.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(DemoError, match="GB free"):
        run_demo(out=tmp_path / "o", progress=False, print_fn=lambda *_: None)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = subprocess.run([sys.executable, "-m", "edgeprobe", "demo", "--out", str(blocker / "out"), "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "cannot create" in r.stderr and "Traceback" not in r.stderr
    for bad, says in ((["--chunk", "0"], "chunk length must be a positive"), (["--repeats", "0"], "repeats must be"),
                      (["--prompt-len", "9000"], "context length")):
        r = subprocess.run([sys.executable, "-m", "edgeprobe", "demo", "--out", str(tmp_path / "o2"), "--no-progress", *bad],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr[-500:])


def test_an_interrupted_demo_stops_cleanly_and_the_rerun_reuses_what_it_finished(tmp_path):
    """Ctrl-C in a terminal (SIGINT to the whole process group, the agent included) mid-demo: a one-line message,
    no traceback, no agent left behind; the next run takes the caches the first one finished and completes."""
    import os
    import signal
    import time

    out = tmp_path / "out"
    args = [sys.executable, "-m", "edgeprobe", "demo", "--out", str(out), "--prompt-len", "128", "--chunk", "64",
            "--profile-tokens", "1024", "--max-windows", "1", "--no-progress"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list((out / ".cache").glob("*-outliers-1024*.npz")) and p.poll() is None:
            assert time.monotonic() < deadline, "the demo never finished its outlier profile"
            time.sleep(0.2)
        assert p.poll() is None, "the demo ended before it could be interrupted"
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert not list(out.glob("report.html"))  # nothing pretends to be finished
    lines = []
    s = run_demo(out=out, prompt_len=128, chunk=64, profile_tokens=1024, eval_windows=1, accuracy_windows=1,
                 repeats=1, progress=False, print_fn=lines.append)
    assert any("perplexity" in line and "(cached)" in line for line in lines)  # finished before the interrupt
    assert s["ooo_ms"] > 0 and (out / "report.html").stat().st_size > 100_000
