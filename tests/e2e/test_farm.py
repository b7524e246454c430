"""One run across a farm of real agents (edgeprobe.farm): a local agent, one deployed over a real sshd, and the
emulated arm64 one under qemu-aarch64, all at once, on a tiny random Llama (milliseconds per run here, seconds under
qemu), so the farm's own behaviour is what takes the time: concurrency, per-device traces, the table, the Perfetto
file, a device lost in the middle."""
import json
import os
import sys

import numpy as np
import pytest

from edgeprobe.device import Device
from edgeprobe.errors import FarmError
from edgeprobe.farm import Farm, device_names

TOKENS = np.arange(1, 9, dtype=np.int32)


def _user() -> str:
    return os.environ.get("USER") or __import__("getpass").getuser()


@pytest.fixture(scope="module")
def three(sshd, module_dir, free_port):
    """A farm of three kinds of device: local, ssh (this host's sshd), arm64 (qemu), opened at once."""
    base = module_dir
    makers = {
        "local": lambda: Device.local(store=base / "local"),
        "ssh": lambda: Device.ssh("127.0.0.1", _user(), sshd["key"], port=sshd["port"], python=sys.executable,
                                  known_hosts=sshd["known_hosts"], remote_dir=str(base / "phone"),
                                  agent_port=free_port(), progress=False),
        "arm64": lambda: Device.local(store=base / "arm64", arch="arm64"),
    }
    farm = Farm.open(makers, opener=lambda make: make())
    yield farm
    farm.close()


def test_one_plan_on_local_ssh_and_arm64_agents_at_once(three, tiny, tmp_path):
    qm = tiny(2, seed=21, scheme="q4_0-tile")
    res = three.prefill(qm, TOKENS)
    assert [r.device for r in res.runs] == ["local", "ssh", "arm64"] and all(r.ok for r in res.runs), res.table()
    # the same plan gave the same logits everywhere (arm64's numpy kernels round float32 sums their own way)
    want = res["local"].value.logits
    for r in res.runs:
        np.testing.assert_allclose(r.value.logits, want, rtol=1e-4, atol=1e-4)
    # at once: one moment when every device was inside its run
    assert max(r.started for r in res.runs) < min(r.started + r.wall_s for r in res.runs)
    rows = {row["device"]: row for row in res.table()}
    assert rows["arm64"]["machine"] == "aarch64" and rows["arm64"]["kernels"] == "numpy"
    assert rows["arm64"]["emulator"] == "qemu-aarch64" and rows["local"]["kernels"] == "numba"
    for name, row in rows.items():
        m = res[name].trace.metrics()
        assert row["makespan_ms"] == m["makespan_ms"] > 0
        assert row["tok_per_s"] == pytest.approx(len(TOKENS) / (m["makespan_ms"] / 1e3))
        assert row["busy_pct"] == {k: v["busy_pct"] for k, v in m["lanes"].items()} and "npu" in row["busy_pct"]
        assert row["upload_mb"] > 0  # each agent got the model's blobs
    text = res.format_table()
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["device", "machine", "kernels"] and "npu busy %" in lines[0]
    assert [l.split()[0] for l in lines[1:]] == ["local", "ssh", "arm64"] and "aarch64 (qemu)" in lines[3]
    # one Perfetto file: a process per device, named by it, a thread per lane, every op of every device
    path = res.to_chrome_json(tmp_path / "farm.json")
    doc = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "local", 2: "ssh", 3: "arm64"}
    for pid, name in names.items():
        ops = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
        assert len(ops) == len(res[name].trace.events)
        lanes = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name" and e["pid"] == pid}
        assert lanes == {res[name].trace.lane_label(l) for l in res[name].trace.lanes}
    assert set(doc["otherData"]["processes"]) == {"local", "ssh", "arm64"}
    # in turn: no two devices inside their runs at the same moment
    seq = three.prefill(qm, TOKENS, concurrent=False)
    spans = sorted((r.started, r.started + r.wall_s) for r in seq.runs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_a_device_lost_mid_run_is_reported_and_the_others_finish(tiny, tmp_path):
    qm = tiny(2, seed=22)
    with Farm.open({"a": tmp_path / "a", "b": tmp_path / "b"}, opener=lambda store: Device.local(store=store)) as farm:
        farm.devices["b"].process.kill()  # the agent dies: its client notices and raises, never hangs
        res = farm.prefill(qm, TOKENS)
    assert res["a"].ok and not res["b"].ok and "exited" in res["b"].error
    rows = res.table()
    assert "makespan_ms" in rows[0] and rows[1]["error"] == res["b"].error
    assert "failed: " in res.format_table().splitlines()[2]
    assert set(res.traces) == {"a"}


def test_devices_that_cannot_be_opened_are_all_named_and_the_rest_closed(tmp_path):
    opened = []

    def opener(spec):
        if spec.startswith("bad"):
            raise ValueError(f"no such device {spec}")
        dev = Device.local(store=tmp_path / spec)
        opened.append(dev)
        return dev

    with pytest.raises(FarmError) as e:
        Farm.open(["good", "bad-1", "bad-2"], opener=opener)
    assert "bad-1 (no such device bad-1)" in str(e.value) and "bad-2 (no such device bad-2)" in str(e.value)
    assert opened and all(d.closed for d in opened) and all(d.process.poll() is not None for d in opened)
    assert device_names(["local", "local", "arm64", "local"]) == ["local", "local#2", "arm64", "local#3"]
