"""The local agent as a process: a chatty stderr never blocks it and is quoted when it dies or fails to start, and
it answers hello and runs without numba (as on a phone under Termux)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from edgeprobe.client import STDERR_TAIL_BYTES
from edgeprobe.device import AgentLostError, Device, DeviceError


def test_a_chatty_agent_never_blocks_and_its_last_words_are_quoted(tmp_path, monkeypatch, slow_plan):
    monkeypatch.setenv("PYTHONVERBOSE", "1")  # every import, to stderr: far more than a pipe holds (64 KiB)
    dev = Device.local(store=tmp_path / "st")
    try:
        plan, inputs = slow_plan(4000)
        pid = dev.put_plan(plan)
        assert dev.stderr.seen > 2 * STDERR_TAIL_BYTES and len(dev.stderr.text().encode()) <= STDERR_TAIL_BYTES
        rid = dev.send("run", list(inputs.values()), plan_id=pid, inputs=list(inputs))
        time.sleep(0.2)
        os.kill(dev.process.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(AgentLostError, match="exited with status -9") as e:
            dev.wait(rid)
        assert time.monotonic() - t0 < 5
        last = dev.stderr.text().strip().splitlines()[-1]
        assert last and last in str(e.value)  # the agent's stderr tail is in the error
    finally:
        dev.close()


def test_an_agent_that_fails_to_start_is_quoted(tmp_path):
    with pytest.raises(DeviceError, match="lanes must be some of") as e:
        Device.local(store=tmp_path / "st", lanes=["cpu", "tpu"])
    assert e.value.code == "agent_start"


def test_hello_and_runs_without_numba(tmp_path, tiny):
    code = ("import sys; sys.modules['numba'] = None\n"  # import numba now raises ImportError
            "from edgeprobe_agent.__main__ import main\nsys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "--bind", "tcp://127.0.0.1:*", "--store", str(tmp_path / "a")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on " in line, proc.stderr.read()[-2000:]
        bare = Device.connect(line.strip().split("listening on ", 1)[1])
        assert bare.info["numba"] is None and bare.info["numba_threading"] is None and bare.info["protocol"] == 1
        qm = tiny(2, seed=11, scheme="llm-int8")
        got = bare.generate(qm, [1, 2, 3], 3, progress=False)
        with Device.local(store=tmp_path / "b") as full:
            assert full.info["numba"]  # this machine has it: the same model there gives the same tokens
            assert full.info["numba_threading"] == "omp"  # one thread a lane: OpenMP (device_agent/__main__.py)
            want = full.generate(qm, [1, 2, 3], 3, progress=False)
        assert np.array_equal(got.tokens, want.tokens)
        assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(got.logits, want.logits))
        bare.close(shutdown=True)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.communicate()  # its pipes closed here, not left to the garbage collector


def test_lanes_with_every_core_run_tbb_where_it_is_installed(tmp_path, monkeypatch):
    """EDGEPROBE_LANE_THREADS=auto (an op computing alone gets every core) picks numba's TBB layer where the tbb
    wheel is installed, as host processes do; one thread a lane keeps OpenMP (device_agent/__main__.py)."""
    from edgeprobe_kernels import TBB

    monkeypatch.delenv("NUMBA_THREADING_LAYER", raising=False)
    monkeypatch.setenv("EDGEPROBE_LANE_THREADS", "auto")
    with Device.local(store=tmp_path / "a") as dev:
        assert dev.info["numba_threading"] == ("tbb" if TBB else "omp")
