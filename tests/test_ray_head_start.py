"""The one start of a local Ray head (edgeprobe.profile.cluster.start_head), used by `--ray local` and the e2e
tests' ray_cluster fixture: a start the raylet aborts because its dashboard agent wrote no port file within Ray's
fixed 15 s (Ray issue 65983) is started again on new ports, up to 3 starts; any other failure is final at once.
Decided on failure texts, without starting Ray."""
import subprocess
from pathlib import Path

import pytest

from edgeprobe.errors import ClusterError
from edgeprobe.profile import cluster
from edgeprobe.profile.cluster import HeadStartError, LocalHead, _raylet_errors, _reason, start_head, start_is_retried

# what _start_head_once collected from a start the raylet aborted (Ray 2.60, 2 cores beside load 9; cut to the head's
# last lines and the raylet's failed check with its first frames): `ray start` names only a generic startup timeout,
# the raylet's log names the dashboard agent's port file
AGENT_TIMEOUT = """2026-11-27 05:58:15,104\tINFO node.py:438 -- Failed to get node info b'GCS cannot find the node \
with node ID 5e9baabb2520f7cefe2385d033e1b208e6dfdc5ea6ee470c90298461. The node registration may not be complete yet \
before the timeout. Try increase the RAY_raylet_start_wait_time_s config.'
Traceback (most recent call last):
  File ".venv/lib/python3.11/site-packages/ray/_private/node.py", line 440, in __init__
    raise Exception(
Exception: The current node timed out during startup. This could happen because some of the raylet failed to startup \
or the GCS has become overloaded.
[2026-11-27 05:58:00,520 C 8285 8285] (raylet) node_manager.cc:3588:  An unexpected system state has occurred. You \
have likely discovered a bug in Ray. Please report this issue at https://github.com/ray-project/ray/issues and we'll \
work with you to fix it. Check failed: statussetor3588.has_value() Timed out waiting for file /tmp/epray-a9szjviq/\
session_2026-11-27_05-57-27_528419_8104/dashboard_agent_listen_port_5e9baabb2520f7cefe2385d033e1b208e6dfdc5ea6ee470c9\
0298461
.venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet(+0x699188) [0x557b8b97b188] \
std::_Function_handler<>::_M_invoke()
.venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet(+0xfc0d92) [0x557b8c2a2d92] \
boost::asio::io_context::run()
"""
PORT_IN_USE = """Usage stats collection is disabled.
ConnectionError: Failed to start GCS server: address 127.0.0.1:41233 already in use (Address already in use)
"""


def test_only_the_agent_port_file_timeout_is_retried():
    assert start_is_retried(AGENT_TIMEOUT)
    for why in (PORT_IN_USE, "Exception: The current node timed out during startup.", ""):
        assert not start_is_retried(why)


def test_the_raylets_failed_check_is_kept_however_long_its_stack_trace():
    check = ("[2026-11-27 03:41:07,512 C 48213 48213] (raylet) node_manager.cc:3557:  Check failed: _s.ok() Bad "
             "status: IOError: Timed out waiting for file /tmp/epray-k2x9qf/session_x/metrics_agent_port_5f1ca2")
    frames = "".join(f".venv/lib/ray/core/src/ray/raylet/raylet(+0x{i:x}) [0x55{i:x}] boost::asio::run()\n"
                     for i in range(200))
    raylet_out = "[2026-11-27 03:40:51,004 I 48213 48213] (raylet) main.cc:180: Setting cluster ID\n" + check + \
        "\n*** StackTrace Information ***\n" + frames
    assert check not in raylet_out[-2000:]  # a plain tail would lose it, and the start would not be retried
    kept = _raylet_errors(raylet_out)
    assert kept.splitlines()[0] == check and kept.endswith(raylet_out[-2000:]) and start_is_retried(kept)
    assert "Setting cluster ID" not in kept
    one = _reason("Exception: The current node timed out during startup.\n" + kept)
    assert "\n" not in one and "Timed out waiting for file" in one and len(one) <= 600


class _Starts:
    """_start_head_once's stand-in: answers the given failure texts in turn ("" = started), each on new ports."""

    def __init__(self, tmp_path, whys):
        self.tmp, self.whys, self.calls = tmp_path, list(whys), []

    def __call__(self, num_cpus, object_store_bytes, env, timeout_s):
        i = len(self.calls)
        self.calls.append((num_cpus, object_store_bytes, timeout_s))
        temp = self.tmp / f"start{i}"
        temp.mkdir()
        proc = subprocess.Popen(["true"])
        proc.wait()
        return LocalHead(proc, temp, 40000 + 2 * i, 40001 + 2 * i), self.whys[i]


def test_an_agent_timeout_is_started_again_on_new_ports_up_to_three_starts(tmp_path, monkeypatch):
    starts = _Starts(tmp_path, [AGENT_TIMEOUT, AGENT_TIMEOUT, ""])
    monkeypatch.setattr(cluster, "_start_head_once", starts)
    said = []
    head = start_head(num_cpus=2, object_store_bytes=100_000_000, env={}, say=said.append)
    assert starts.calls == [(2, 100_000_000, 180)] * 3
    assert (head.address, head.client) == ("127.0.0.1:40004", "ray://127.0.0.1:40005")
    assert not (tmp_path / "start0").exists() and not (tmp_path / "start1").exists()  # failed starts' temp dirs
    assert len(said) == 2 and "Ray issue 65983" in said[0] and said[1].endswith("(3/3)")
    head.stop()
    assert not (tmp_path / "start2").exists()

    starts = _Starts(tmp_path / "b", [AGENT_TIMEOUT] * 4)
    starts.tmp.mkdir()
    monkeypatch.setattr(cluster, "_start_head_once", starts)
    with pytest.raises(HeadStartError) as e:
        start_head(num_cpus=2, env={})
    assert len(starts.calls) == 3 and e.value.why == AGENT_TIMEOUT and isinstance(e.value, ClusterError)
    assert "\n" not in str(e.value) and str(e.value).startswith("`ray start --head` did not start: ")


def test_any_other_failure_is_final_at_once(tmp_path, monkeypatch):
    starts = _Starts(tmp_path, [PORT_IN_USE, ""])
    monkeypatch.setattr(cluster, "_start_head_once", starts)
    with pytest.raises(HeadStartError) as e:
        start_head(num_cpus=2, env={})
    assert len(starts.calls) == 1 and e.value.why == PORT_IN_USE and not (tmp_path / "start0").exists()


def test_ray_local_starts_its_cluster_through_start_head(monkeypatch):
    asked = []

    def refuse(num_cpus, object_store_bytes, say=None, **kw):
        asked.append((num_cpus, object_store_bytes))
        raise HeadStartError("`ray start --head` did not start: recorded", AGENT_TIMEOUT)

    monkeypatch.setattr(cluster, "start_head", refuse)
    with pytest.raises(HeadStartError):
        cluster.RayRunner("local", num_cpus=3, say=lambda m: None)
    assert asked == [(3, cluster.LOCAL_OBJECT_STORE_BYTES)]


def test_the_e2e_fixture_uses_the_library_start():
    src = (Path(__file__).resolve().parent / "e2e" / "conftest.py").read_text()
    assert "start_head(" in src and '"start", "--head"' not in src  # one implementation of the start and its retry
