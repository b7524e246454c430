"""`edgeprobe run` as a user runs it, in real processes against real local agents: a second run reuses the first
one's preparation, a short prompt file is prefilled whole, and two runs at once both succeed."""
import json
import os
import subprocess
import sys

import pytest

from edgeprobe import Device


@pytest.fixture(scope="module")
def env(module_dir):
    base = module_dir
    (base / "short.txt").write_text("def f(x): return x + 1\n")  # 11 tokens
    e = {**os.environ, "TMPDIR": str(base), "EDGEPROBE_PREPARED_CACHE": str(base / "prepared"),
         "EDGEPROBE_AGENT_STORE": str(base / "store")}
    return base, e


def _run(env, *extra, wait=True):
    cmd = [sys.executable, "-m", "edgeprobe", "run", "--scheme", "q4_0-tile", "--prompt-file",
           str(env[0] / "short.txt"), "--prompt-len", "64", "--no-progress", "--json", *extra]
    p = subprocess.Popen(cmd, env=env[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p.communicate(timeout=600) + (p.returncode,) if wait else p


# the agent's npu lane sums q4_0-tile's products in k order, the host's simulation in BLAS's: max |diff| / max |logit|
# 4.4e-4 and 1 - cosine 8e-9 seen on this prompt; the float model's logits are at 1 - cosine ~1e-2
COSINE_GAP = 1e-6


def test_a_second_run_reuses_the_first_runs_preparation_and_a_short_prompt_is_run_whole(env, tmp_path):
    from edgeprobe.quant import QuantizedModel

    # a prepared-model cache and an agent store of its own: the module's other tests fill theirs, in any order
    prepared = tmp_path / "prepared"
    env = (env[0], {**env[1], "EDGEPROBE_PREPARED_CACHE": str(prepared), "EDGEPROBE_AGENT_STORE": str(tmp_path / "st")})
    out, err, rc = _run(env)
    assert rc == 0, err
    first = json.loads(out.splitlines()[-1])
    assert first["tokens"] == 11 and "fewer than --prompt-len 64: prefilling all 11" in err
    entry, = prepared.iterdir()  # prepared once, published whole: no temporary folder left
    assert entry.name.startswith("smollm2-135m-q4_0-tile-") and QuantizedModel.load(entry).scheme == "q4_0-tile"
    assert first["upload_bytes"] == sum(b["nbytes"] for b in json.loads((entry / "manifest.json").read_text())
                                        ["blobs"].values())
    made = (entry / "manifest.json").stat().st_mtime_ns, prepared.stat().st_mtime_ns
    out, err, rc = _run(env)
    assert rc == 0, err
    second = json.loads(out.splitlines()[-1])
    # read, not prepared again: a second preparation would have written a temporary folder beside the entry (an
    # edit to the quantizer or the kernels between the two runs keys a new entry: prepared again, rightly)
    assert list(prepared.iterdir()) == [entry]
    assert ((entry / "manifest.json").stat().st_mtime_ns, prepared.stat().st_mtime_ns) == made
    # the same blobs (content-addressed), so the agent's store needs nothing new and does not grow
    assert second["upload_bytes"] == 0
    assert 1 - second["logits_cosine_vs_host"] < COSINE_GAP


def test_two_runs_at_once_beside_an_agent_holding_the_store_all_succeed(env):
    base, e = env
    with Device.local(store=base / "store"):  # a notebook's agent holding the default store
        runs = [_run(env, wait=False) for _ in range(2)]
        results = [p.communicate(timeout=600) + (p.returncode,) for p in runs]
    stores = set()
    for out, err, rc in results:
        assert rc == 0, err
        assert json.loads(out.splitlines()[-1])["tokens"] == 11
        line, = [l for l in err.splitlines() if "is in use by another agent" in l]  # said in one line
        stores.add(line.split("this run's agent uses ")[1].split(" ")[0])
    assert stores == {str(base / "store-2"), str(base / "store-3")}  # one store each, picked without a collision


def test_store_flag_names_the_local_agents_store(env, tmp_path):
    out, err, rc = _run(env, "--store", str(tmp_path / "mine"))
    assert rc == 0, err
    assert (tmp_path / "mine" / "blobs").is_dir() and "uploaded" in err
    out, err, rc = _run(env, "--store", str(tmp_path / "x"), "--device", "tcp://127.0.0.1:9")
    assert rc == 2 and err.count("\n") == 1 and "--store is the local agent's flash" in err


def test_several_devices_run_one_prefill_at_once_and_print_a_comparison(env, tmp_path):
    trace = tmp_path / "farm.json"
    out, err, rc = _run(env, "--device", "local", "--device", "local", "--trace", str(trace))
    assert rc == 0, err
    doc = json.loads(out.splitlines()[-1])
    assert [d["device"] for d in doc["devices"]] == ["local", "local#2"] and doc["concurrent"] is True
    for d, row in zip(doc["devices"], doc["comparison"]):  # each device's fields are a one-device run's
        assert d["tokens"] == 11 and 1 - d["logits_cosine_vs_host"] < COSINE_GAP
        assert d["agent_machine"] == row["machine"]
        assert row["makespan_ms"] == d["makespan_ms"] > 0 and row["tok_per_s"] == pytest.approx(d["tok_per_s"])
        assert row["cosine_vs_host"] == d["logits_cosine_vs_host"] and row["busy_pct"]["npu"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"local", "local#2"}
    assert {e["pid"] for e in events if e["ph"] == "X"} == {1, 2}
    # what a farm cannot do is said in one line, before any agent starts
    for extra, msg in ((["--decode", "2"], "--decode runs on one device"),
                       (["--store", str(tmp_path / "s")], "--store is one agent's flash"),
                       (["--device", "phone"], "--device 'phone': use local, arm64")):
        out, err, rc = _run(env, "--device", "local", "--device", "local", *extra)
        assert rc == 2 and err.count("\n") == 1 and msg in err, err
