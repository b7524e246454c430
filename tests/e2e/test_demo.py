"""The main job end to end, small: profile, quantize, schedule, run on a local agent, report — then the report
looked at in a real headless Chromium (the plotly charts drew their SVG layers) and a second run from caches."""
import json
import subprocess
import sys

import numpy as np
import pytest

from edgeprobe.browser import dump_dom, screenshot
from edgeprobe.demo import DemoError, run_demo


def _ooo_mechanism(out, summary):
    """mllm-NPU §3.4's mechanism where it is deterministic: the two schedules the demo ran, rebuilt from its cached
    cost model (the demo's own model and prompt), respect every dependency and the one-subgraph-per-lane rule;
    out-of-order reorders the npu lane, which the cost model predicts leaves the npu idle less; and the measured
    out-of-order trace ran each lane in the schedule's order, every op after the ops it reads."""
    from edgeprobe import models
    from edgeprobe.schedule import chunk_graph, schedule
    from edgeprobe.schedule.measure import MeasuredProfile

    m = models.load("smollm2-135m")
    prof = MeasuredProfile.from_json(next((out / ".cache").glob("smollm2-135m-profile-w8a8-shadow-*.json")))
    graph = chunk_graph(m.config, summary["prompt_len"], summary["chunk"], shadow=prof.meta["shadow_layers"])
    sched = {s: schedule(graph, prof, s) for s in ("in-order", "ooo")}
    for s in sched.values():
        s.check()
    assert summary["predicted_in_order_ms"] == pytest.approx(sched["in-order"].makespan_us / 1e3, abs=0.051)
    assert summary["predicted_ooo_ms"] == pytest.approx(sched["ooo"].makespan_us / 1e3, abs=0.051)

    def lane_order(s, lane):
        return [n for n in sorted(s.slots, key=lambda n: s.slots[n][1]) if s.slots[n][0] == lane]

    npu = {k: lane_order(s, "npu") for k, s in sched.items()}
    assert sorted(npu["ooo"]) == sorted(npu["in-order"]) and npu["ooo"] != npu["in-order"]
    g = graph.by_name()
    program = [(g[n].chunk, g[n].layer) for n in npu["in-order"]]
    assert program == sorted(program)  # in-order: chunk-major program order

    def npu_idle_us(s):  # the npu lane's gaps between its first start and the makespan's end
        iv = sorted((a, b) for lane, a, b in s.slots.values() if lane == "npu")
        return s.makespan_us - sum(b - a for a, b in iv)

    assert npu_idle_us(sched["ooo"]) < npu_idle_us(sched["in-order"])
    # the measured out-of-order run (trace.json): each lane ran its ops in the schedule's order of subgraphs
    trace = json.loads((out / "trace.json").read_text())
    lanes = {e["tid"]: e["args"]["name"].split(" ")[0] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    ran = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {lanes[e["tid"]] for e in ran} >= {"cpu", "npu"}
    for lane in ("cpu", "npu"):
        seq = [(e["args"]["chunk"], e["args"]["layer"]) for e in sorted(ran, key=lambda e: e["ts"])
               if lanes[e["tid"]] == lane and e["args"].get("layer", -1) >= 0]
        planned = [(g[n].chunk, g[n].layer) for n in lane_order(sched["ooo"], lane)]
        assert [x for k, x in enumerate(seq) if k == 0 or x != seq[k - 1]] == \
            [x for k, x in enumerate(planned) if k == 0 or x != planned[k - 1]], lane
    # every cross-lane dependency arrow starts before the op that waits on it
    starts = {e["id"]: e["ts"] for e in trace["traceEvents"] if e["ph"] == "s"}
    ends = [(starts[e["id"]], e["ts"]) for e in trace["traceEvents"] if e["ph"] == "f"]
    assert ends and all(a <= b for a, b in ends)


def test_demo_writes_a_report_that_renders_in_chromium_and_reruns_from_caches(tmp_path, monkeypatch):
    out = tmp_path / "out"
    lines = []
    kw = dict(out=out, prompt_len=128, chunk=64, profile_tokens=1024, eval_windows=1, accuracy_windows=1, repeats=2,
              progress=False, print_fn=lines.append)
    s = run_demo(**kw)
    print("\ndemo summary:", json.dumps({k: v for k, v in s.items() if k not in ("report", "trace", "timeline")}))
    # out-of-order scheduling is asserted on the schedules, the predicted makespans and the measured run's order
    # (_ooo_mechanism); the measured makespans are reported, never ordered: on shared cores their ratio is the
    # machine's load (0.95-1.17x seen), and bench/schedule.py measures it
    _ooo_mechanism(out, s)
    assert s["ooo_vs_in_order"] == pytest.approx(s["ooo_ms"] / s["in_order_ms"], abs=2e-3)
    assert 0 < s["predicted_ooo_ms"] < s["predicted_in_order_ms"]
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
    # the rerun takes every expensive result from out/.cache: none of them runs again, no cache file is rewritten
    cached = {p: p.stat().st_mtime_ns for p in (out / ".cache").iterdir() if p.is_file()}
    assert len([p for p in cached if p.suffix in (".json", ".npz")]) == 5  # eval, 2 profiles, accuracy, cost model
    from edgeprobe import demo, device
    from edgeprobe.profile import jobs
    from edgeprobe.quant import report

    def ran_again(*a, **k):
        raise AssertionError("the rerun recomputed what the first run cached")

    with monkeypatch.context() as mp:
        for where, name in ((demo, "perplexity"), (jobs, "profile_outliers"), (jobs, "profile_sparsity"),
                            (report, "accuracy_table"), (device.Device, "measure_profile"),
                            (device.Device, "measure_cost_model")):
            if hasattr(where, name):
                mp.setattr(where, name, ran_again)
        s2 = run_demo(**{**kw, "print_fn": [].append, "repeats": 1})
    assert {p: p.stat().st_mtime_ns for p in cached} == cached
    assert s2["accuracy"] == s["accuracy"] and s2["perplexity_heldout"] == s["perplexity_heldout"]
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
        r = subprocess.run([sys.executable, "-m", "edgeprobe", "demo", "--out", str(tmp_path / "o2"), "--no-progress",
                            *bad],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr[-500:])


def test_an_interrupted_demo_stops_cleanly_and_the_rerun_reuses_what_it_finished(tmp_path, monkeypatch):
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
    # the held-out perplexity finished before the interrupt (the outlier profile comes after it): the rerun reads it
    evals = list((out / ".cache").glob("*-eval-1.json"))
    assert len(evals) == 1
    made = evals[0].stat().st_mtime_ns
    from edgeprobe import demo

    def ran_again(*a, **k):
        raise AssertionError("the rerun recomputed the perplexity the interrupted run had cached")

    monkeypatch.setattr(demo, "perplexity", ran_again)
    s = run_demo(out=out, prompt_len=128, chunk=64, profile_tokens=1024, eval_windows=1, accuracy_windows=1,
                 repeats=1, progress=False, print_fn=[].append)
    assert evals[0].stat().st_mtime_ns == made
    assert s["ooo_ms"] > 0 and (out / "report.html").stat().st_size > 100_000
