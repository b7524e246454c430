"""Plans run on the host, in-process: the agent's own executor and op registry, without a socket.

The same Plan runs here, on the cost model (a predicted trace) and on an agent (a measured trace); running it
here is how tests check that a plan computes what `forward()` computes, and how a notebook can look at a
plan's trace without a device.
"""
from __future__ import annotations

import numpy as np

from edgeprobe_agent.executor import Context, execute, validate
from edgeprobe_agent.session import KVSession


def host_session(config: dict, batch: int, capacity: int) -> KVSession:
    """A decode session's KV cache, as the agent keeps one (float32[batch, n_kv_heads, capacity, head_dim] per layer)."""
    return KVSession(config["n_layers"], config["n_kv_heads"], config["head_dim"], batch, capacity)


def run_plan(plan: dict, get, inputs: dict, session: KVSession | None = None, advance: int = 0):
    """Validate and execute `plan` here. get: sha -> array (a QuantizedModel's `store.get`). inputs: run inputs
    ({"tokens": int32[batch * T]}). session/advance: a decode session the run extends by `advance` positions.
    Returns ({output name: array}, trace events, counters)."""
    p = validate(plan, has_blob=lambda s: True)
    counters: dict = {}
    ctx = Context(get=get, counters=counters, session=session,
                  read_rows=lambda sha, rows, lane="io": np.asarray(get(sha))[np.asarray(rows)],
                  read_blob=lambda sha, lane="io": get(sha))
    outs, events = execute(p, {k: np.asarray(v) for k, v in inputs.items()}, ctx)
    if session is not None:
        session.length += advance  # as the agent: only a whole run moves the cache on
    return outs, events, counters
