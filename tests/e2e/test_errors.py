"""Errors that used to mislead, each now one line on stderr and exit 2 from `edgeprobe run` (and one error type from
the Python API), against real parts: a port nothing listens on, an HTTP server, a port that accepts and never
answers, a real local agent killed with SIGKILL."""
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from edgeprobe import Device
from edgeprobe.errors import (
    AgentLostError,
    AgentUnreachableError,
    DeployError,
    NotAnAgentError,
    NotSSHServerError,
    SSHTimeoutError,
)

HANG_S = 120  # a generous bound on a whole CLI process (imports and a model load on a busy machine): catches a hang


def _cli(*args, env=None, timeout=HANG_S):
    p = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--no-progress", *args], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    return p.returncode, p.stdout, p.stderr


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("edgeprobe: error: "), err
    return lines[0]


@pytest.fixture
def closed_port():
    """A loopback port bound and closed again: nothing listens on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_port():
    """A real HTTP server (http.server) on a thread, on a loopback port."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def silent_port():
    """A port that accepts connections and never sends a byte (a hung service); the connections are held open."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(timeout=5)
    for c in held:
        c.close()
    srv.close()


def test_nothing_listening_says_so_and_how_to_start_an_agent(closed_port):
    url = f"tcp://127.0.0.1:{closed_port}"
    rc, _, err = _cli("--device", url)
    line = _one_error_line(err)
    assert rc == 2
    assert f"nothing is listening at {url}" in line
    # the hint names only what works: an agent off loopback refuses to start without CURVE keys
    assert f"edgeprobe agent --bind tcp://127.0.0.1:{closed_port}" in line and "--device local" in line
    assert "0.0.0.0" not in line
    assert "killed" not in line  # no agent was ever there
    with pytest.raises(AgentUnreachableError, match="nothing is listening") as e:
        Device.connect(url)
    assert not isinstance(e.value, NotAnAgentError) and "\n" not in str(e.value)


def test_an_http_server_is_not_an_agent(http_port):
    url = f"tcp://127.0.0.1:{http_port}"
    rc, _, err = _cli("--device", url)
    line = _one_error_line(err)
    assert rc == 2
    assert f"{url} is not an edgeprobe agent" in line and "killed" not in line
    with pytest.raises(NotAnAgentError, match="not an edgeprobe agent"):
        Device.connect(url)


def test_a_silent_port_is_not_an_agent(silent_port):
    with pytest.raises(NotAnAgentError, match="sent no ZeroMQ greeting within"):
        Device.connect(f"tcp://127.0.0.1:{silent_port}")


def test_ssh_to_an_http_server_is_not_an_ssh_server(http_port, tmp_path):
    key = tmp_path / "key"
    key.write_text("not read: the port is refused before any key is\n")
    rc, _, err = _cli("--device", f"ssh://user@127.0.0.1:{http_port}", "--ssh-key", str(key))
    line = _one_error_line(err)  # no paramiko traceback
    assert rc == 2
    assert f"not an SSH server at 127.0.0.1:{http_port}" in line and "HTTP server" in line
    with pytest.raises(NotSSHServerError):
        Device.ssh("127.0.0.1", "user", key, port=http_port, progress=False)


def test_a_missing_ssh_key_is_named_before_any_connection(closed_port, tmp_path):
    for key, what in ((tmp_path / "no-such-key", "does not exist"), (tmp_path, "is a folder")):
        rc, _, err = _cli("--device", f"ssh://user@127.0.0.1:{closed_port}", "--ssh-key", str(key))
        line = _one_error_line(err)
        assert rc == 2 and f"the SSH key {key} {what}" in line and "--ssh-key PATH" in line
        assert "listening" not in line and "reach" not in line  # the port (closed) was never tried
        with pytest.raises(DeployError, match=what):
            Device.ssh("127.0.0.1", "user", key, port=closed_port, progress=False)


def test_an_ssh_port_that_never_answers_names_the_timeout(silent_port, tmp_path):
    from edgeprobe.deploy import BANNER_TIMEOUT_S

    key = tmp_path / "key"
    key.write_text("unused\n")
    rc, _, err = _cli("--device", f"ssh://user@127.0.0.1:{silent_port}", "--ssh-key", str(key))
    line = _one_error_line(err)
    assert rc == 2
    assert f"no SSH banner from 127.0.0.1:{silent_port} within {BANNER_TIMEOUT_S:g} s" in line
    assert "No existing session" not in line
    with pytest.raises(SSHTimeoutError) as e:
        Device.ssh("127.0.0.1", "user", key, port=silent_port, progress=False)
    assert isinstance(e.value, DeployError)


def _killed_agents_error(dev) -> str:
    """SIGKILL a local agent, then use it: the error the client raises."""
    os.kill(dev.process.pid, signal.SIGKILL)
    dev.process.wait(timeout=10)
    with pytest.raises(AgentLostError) as e:
        dev.stats()
    return str(e.value)


def test_a_killed_agent_that_wrote_nothing_says_so(tmp_path):
    dev = Device.local(store=tmp_path / "st")
    try:
        msg = _killed_agents_error(dev)
        assert "\n" not in msg and msg.endswith("it wrote nothing on stderr"), msg
        assert "exited with status -9 (killed by SIGKILL)" in msg
    finally:
        dev.close()


def test_a_killed_agent_quotes_its_real_last_stderr_lines_on_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONVERBOSE", "1")  # the agent's interpreter writes every import to stderr
    dev = Device.local(store=tmp_path / "st")
    try:
        msg = _killed_agents_error(dev)
        last = [ln.strip() for ln in dev.stderr.text().splitlines() if ln.strip()]
        assert last and "\n" not in msg
        assert msg.endswith("its stderr ends: " + " | ".join(last[-3:])), msg
    finally:
        dev.close()


@pytest.mark.parametrize("scheduler", ["layer", "hetero"])
def test_chunk_without_a_chunked_scheduler_is_refused(scheduler):
    rc, out, err = _cli("--scheduler", scheduler, "--chunk", "64", "--prompt-len", "16")
    line = _one_error_line(err)
    assert rc == 2 and out == ""
    assert "--chunk applies to the chunked prefill (--scheduler in-order or ooo)" in line
    assert f"--scheduler {scheduler} " in line


def test_a_chunk_longer_than_the_prompt_is_one_chunk_and_said(tmp_path):
    rc, out, err = _cli("--scheme", "q4_0-tile", "--scheduler", "in-order", "--chunk", "512", "--prompt-len", "16",
                        "--json", env={"EDGEPROBE_AGENT_STORE": str(tmp_path / "store"),
                                       "EDGEPROBE_PREPARED_CACHE": str(tmp_path / "prepared")}, timeout=600)
    assert rc == 0, err
    assert "--chunk 512 is longer than the 16-token prompt: prefilling it as one chunk of 16 tokens" in err
    got = json.loads(out.splitlines()[-1])
    assert got["chunk"] == 16 and got["tokens"] == 16 and got["scheduler"] == "in-order"
