"""Deployment over a real OpenSSH server on 127.0.0.1 (standing in for Termux's sshd on a phone)."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeprobe.deploy import DeployError
from edgeprobe.device import Device


def test_deploy_run_and_redeploy_over_ssh(sshd, tmp_path, free_port):
    user = os.environ.get("USER") or __import__("getpass").getuser()
    remote = str(tmp_path / "remote")
    dev = Device.ssh("127.0.0.1", user, sshd["key"], port=sshd["port"], python=sys.executable,
                     known_hosts=sshd["known_hosts"], remote_dir=remote, agent_port=free_port(), progress=False)
    try:
        assert dev.info["protocol"] == 1 and "npu" in dev.info["lanes"]
        assert (Path(remote) / "edgeprobe_agent" / "server.py").exists()
        pid = dev.put_plan({"ops": [{"name": "a", "kind": "add", "lane": "cpu",
                                     "inputs": [{"input": "x"}, {"input": "x"}]}]})
        r = dev.run(pid, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
        assert np.array_equal(r.logits, 2 * np.arange(6, dtype=np.float32).reshape(2, 3))
    finally:
        dev.close()
    # a second deployment copies nothing that has not changed
    from edgeprobe.deploy import _client, sync_packages

    c = _client("127.0.0.1", user, sshd["key"], sshd["port"], sshd["known_hosts"], None)
    assert sync_packages(c, remote, progress=False) == 0
    c.close()


def test_unknown_or_wrong_host_key_is_refused(sshd, tmp_path):
    user = os.environ.get("USER") or __import__("getpass").getuser()
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with pytest.raises(DeployError, match="known_hosts"):
        Device.ssh("127.0.0.1", user, sshd["key"], port=sshd["port"], known_hosts=empty, remote_dir=str(tmp_path / "r"))
    with pytest.raises(DeployError):
        Device.ssh("127.0.0.1", user, sshd["key"], port=sshd["port"], known_hosts=sshd["dir"] / "wrong_known_hosts",
                   remote_dir=str(tmp_path / "r"))
    with pytest.raises(DeployError, match="host key"):
        Device.ssh("127.0.0.1", user, sshd["key"], port=sshd["port"], host_fingerprint="SHA256:AAAA",
                   remote_dir=str(tmp_path / "r"))
