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
from .client import AgentLostError, Client, DeviceError, RunResult, StderrTail, _plain, _read_listen_line  # noqa: F401
from .sampling import sample  # noqa: F401
from .workflows import DecodeSession, Decoded  # noqa: F401


class Device(Client):
    """A client of the device agent with the workflows as methods: `dev.prefill(...)` is
    `workflows.prefill(dev, ...)`; connect with Device.local() / connect(url) / ssh(...)."""

    prefill = workflows.prefill
    prefill_chunked = workflows.prefill_chunked
    prefill_hetero = workflows.prefill_hetero
    session = workflows.session
    generate = workflows.generate
    measure_linears = workflows.measure_linears
    measure_profile = workflows.measure_profile
