"""The host side of the device agent as users meet it: `Device` is the thin client (client.py) with the
workflows (workflows.py) attached as methods.

    with Device.local() as dev:                     # an agent subprocess on a free loopback port
        dev.upload(qm)                               # only the blobs the agent lacks, chunked, resumable
        res = dev.prefill(qm, tokens)                # logits of the last token + a Trace
Every call waits for exactly one final reply; while waiting it expects the agent's progress or
heartbeat messages and raises AgentLostError after HEARTBEAT_TIMEOUT_S of silence — never hangs.
"""
from __future__ import annotations

from . import workflows
from .client import Client, RunResult
from .errors import AgentLostError, DeviceError
from .local_agent import StderrTail
from .sampling import sample
from .workflows import Decoded, DecodeSession

# users import these from here (edgeprobe.device is where a session starts); each lives in the module named above
__all__ = ["Device", "open_device", "check_device_spec", "DEVICE_SPECS", "Client", "RunResult", "DeviceError",
           "AgentLostError", "StderrTail", "DecodeSession", "Decoded", "sample"]


class Device(Client):
    """A client of the device agent with the workflows as methods: `dev.prefill(...)` is
    `workflows.prefill(dev, ...)`; connect with Device.local() / connect(url) / ssh(...)."""

    prefill = workflows.prefill
    prefill_chunked = workflows.prefill_chunked
    prefill_hetero = workflows.prefill_hetero
    session = workflows.session
    generate = workflows.generate
    measure_linears = workflows.measure_linears
    measure_cost_model = workflows.measure_cost_model
    measure_profile = workflows.measure_cost_model  # the old name


DEVICE_SPECS = "local, arm64, tcp://HOST:PORT or ssh://USER@HOST[:PORT]"


def _ssh_parts(spec: str) -> tuple[str, str, int]:
    user, _, hostport = spec[len("ssh://"):].rpartition("@")
    host, _, port = hostport.partition(":")
    if not user or not host or not (port or "22").isdigit():
        raise ValueError(f"--device {spec!r}: write ssh://USER@HOST[:PORT]")
    return user, host, int(port or 22)


def check_device_spec(spec: str) -> None:
    """ValueError naming the problem unless `spec` is a device `open_device` can open (nothing is opened)."""
    if spec in ("local", "arm64", "aarch64") or spec.startswith(("tcp://", "ipc://")):
        return
    if spec.startswith("ssh://"):
        _ssh_parts(spec)
        return
    raise ValueError(f"--device {spec!r}: use {DEVICE_SPECS}")


def open_device(spec: str, ssh_key=None, known_hosts=None, store=None, npu_backend=None, say=None,
                progress: bool = True) -> Device:
    """--device local | arm64 | tcp://HOST:PORT | ssh://USER@HOST[:PORT] -> a connected Device. arm64: a local agent in
    Debian's arm64 Python under qemu-aarch64, without numba (the emulated phone CPU; scripts/arm64_python.sh)."""
    check_device_spec(spec)
    if spec == "local":
        return Device.local(store=store, npu_backend=npu_backend, say=say)
    if spec in ("arm64", "aarch64"):
        return Device.local(store=store, npu_backend=npu_backend, say=say, arch="arm64")
    if spec.startswith(("tcp://", "ipc://")):
        return Device.connect(spec)
    user, host, port = _ssh_parts(spec)
    if not ssh_key:
        raise ValueError("--device ssh://... needs --ssh-key PATH (the private key the device accepts)")
    return Device.ssh(host, user, ssh_key, port=port, known_hosts=known_hosts, progress=progress)
