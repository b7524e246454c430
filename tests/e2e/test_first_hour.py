"""What a new user meets in the first hour, each once a traceback, a stale file or a word that was not true: the
generate command's bad input, where a local agent's store lives, a store lock left by a killed agent, the labels
and the summary a user reads."""
import os
import signal
import subprocess
import sys

import pytest

from edgeprobe import Device
from edgeprobe.trace import Trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("args, words", [(["-n", "-3", "--prompt", "hi"], "-n -3: the number of tokens to generate "
                                          "must be 0 or more"),
                                         (["--prompt", ""], "the prompt is empty")])
def test_generate_refuses_bad_input_in_one_line_with_exit_2(args, words):
    p = subprocess.run([sys.executable, "-m", "edgeprobe", "generate", *args], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("edgeprobe: error: ") and words in line


def test_generate_refuses_them_from_python_too(smollm):
    from edgeprobe.errors import TextError, TokenRangeError
    from edgeprobe.generate import generate

    with pytest.raises(TokenRangeError):
        generate(smollm, "hi", n=-1)
    with pytest.raises(TextError):
        generate(smollm, "")


def test_a_local_agents_default_store_lives_under_the_edgeprobe_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPROBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EDGEPROBE_AGENT_STORE", raising=False)
    with Device.local() as dev:
        assert dev.store == tmp_path / "cache" / "agent-store" and (dev.store / ".lock").exists()


def test_a_store_lock_left_by_a_killed_agent_is_taken_over_and_a_stopped_one_leaves_none(tmp_path):
    store = tmp_path / "st"
    dev = Device.local(store=store)
    killed = dev.process.pid
    assert (store / ".lock").read_text() == str(killed)
    os.kill(killed, signal.SIGKILL)
    dev.process.wait(timeout=10)
    dev.close()
    assert (store / ".lock").read_text() == str(killed)  # SIGKILL: nothing could clear it
    with Device.local(store=store) as again:
        assert (store / ".lock").read_text() == str(again.process.pid)
        assert f"last locked by pid {killed}, which ended without releasing it; its lock is taken over" in \
            again.stderr.text(wait_s=1.0)
    assert (store / ".lock").read_text() == ""  # a clean stop clears its pid: the next agent finds no stale one


def test_lanes_of_a_measured_cost_model_read_as_what_their_times_are():
    ev = [{"name": "m", "kind": "matmul", "lane": "npu", "start_us": 0.0, "end_us": 1.0, "predicted": True}]
    label = lambda cm: Trace(ev, {"predicted": True, "cost_model": cm, "modelled": False}).lane_label("npu")
    assert label("measured-predicted") == "npu (predicted: fitted to the agent's measured times)"
    assert label("measured-real") == "npu (predicted: the agent's measured times)"


def test_the_demo_summary_quotes_only_what_exists():
    import re

    from edgeprobe.demo import summary_rows

    s = {"perplexity_heldout": 13.6, "perplexity_windows": 8, "perplexity_window": 512, "accuracy_windows": 4,
         "accuracy_window": 256, "outlier_channels_pct": 1.0, "channels_for_80pct_outliers_pct": 0.5,
         "ffn_inactive_fraction": 0.2, "accuracy": {"float": {"perplexity": 14.7, "delta_vs_float_pct": None}},
         "repeats": 2, "prompt_len": 1024, "chunk": 256, "in_order_ms": 1000, "predicted_in_order_ms": 900,
         "ooo_ms": 900, "predicted_ooo_ms": 700, "ooo_vs_in_order": 0.9, "busy_pct_ooo": {"npu": 90},
         "chunk_shared_memory_saving": 0.6, "report": "r", "trace": "t"}
    text = " ".join(f"{a} {b}" for a, b in summary_rows(s))
    assert "README" not in text  # the README holds no ratio of this run to compare with
    for path in re.findall(r"\b[\w/]+\.(?:py|md)\b", text):
        assert os.path.exists(os.path.join(ROOT, path)), path
