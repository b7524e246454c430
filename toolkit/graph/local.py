"""Plans run on the host, in-process: the agent's own executor and op registry, without a socket.

The same Plan runs here, on the cost model (a predicted trace) and on an agent (a measured trace); running it
here is how tests check that a plan computes what `forward()` computes, and how a notebook can look at a
plan's trace without a device. `float_plan` / `run_float` are the host's float pass itself (edgeprobe.forward):
the template's ops with float records, named weights, and the host's own functions for some op kinds (its
linears, its LM head, hooks at op outputs) in place of the agent's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeprobe_agent.executor import Context, execute, run_ops, run_untraced, validate
from edgeprobe_agent.protocol import AgentError
from edgeprobe_agent.session import KVSession
from edgeprobe_kernels import names as N
from edgeprobe_kernels.threads import host_pass

from .template import Weights, model_ops


def host_session(config: dict, batch: int, capacity: int) -> KVSession:
    """A decode session's KV cache as the agent keeps one (float32[batch, n_kv_heads, capacity, head_dim] a layer)."""
    return KVSession(config["n_layers"], config["n_kv_heads"], config["head_dim"], batch, capacity)


def run_plan(plan: dict, get, inputs: dict, session: KVSession | None = None, advance: int = 0):
    """Validate and execute `plan` here. get: sha -> array (a QuantizedModel's `store.get`). inputs: run inputs
    ({"tokens": int32[batch * T]}). session/advance: a decode session the run extends by `advance` positions.
    Returns ({output name: array}, trace events, counters). Threads: the cores other processes leave free
    (edgeprobe_kernels.threads.host_pass, as the host's other passes; the agent's Cores are not enabled here)."""
    p = validate(plan, has_blob=lambda s: True)
    counters: dict = {}
    ctx = Context(get=get, counters=counters, session=session,
                  read_rows=lambda sha, rows, lane="io": np.asarray(get(sha))[np.asarray(rows)],
                  read_blob=lambda sha, lane="io": get(sha))
    with host_pass():
        outs, events = execute(p, {k: np.asarray(v) for k, v in inputs.items()}, ctx)
    if session is not None:
        session.length += advance  # as the agent: only a whole run moves the cache on
    return outs, events, counters


@dataclass
class HostContext(Context):
    """A Context whose `host` is what the host's own op functions read (forward's linear, hooks and head)."""
    host: object = None


class HostRaised(AgentError):
    """An error of a host callable (a hook's, a linear's) carried through the executor, raised as it was by
    run_float (the executor reports any other exception of an op as op_failed)."""

    def __init__(self, error: BaseException):
        super().__init__("host_error", str(error))
        self.error = error


# op kinds whose weights the host's functions read from the model (a quantized model's stripped float model has no
# router or head to hand over): the plan gives them their activations alone
HOST_READS = ("moe_ffn", "lm_head")
_PLANS: dict = {}
_MAX_PLANS = 64


def float_plan(config, tokens: int, batch: int, session: bool, logits: str, registry: dict):
    """The validated plan of the host's float pass over `tokens` new positions of `batch` sequences (session: they
    extend a KV cache), all on one lane in program order. logits "all" | "last" (lm_head of every row or the last
    of each sequence) | "none" (the plan ends at output_norm). Inputs name the model's tensors ({"blob": name});
    every op carries its name (attrs op), one whose output is a hook point that point (attrs hook), a linear
    its name as a linear (attrs linear). Kept per
    shape: a decode loop builds its step's plan once."""
    try:
        key = (config, tokens, batch, session, logits, id(registry))
        hash(key)
    except TypeError:
        key = (repr(config), tokens, batch, session, logits, id(registry))
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    ops = model_ops(Weights(config, shadow=False, floats=True), tokens, batch=batch, session=session,
                    last_only=logits == "last")
    if logits == "none":
        ops = ops[:-1]
    for op in ops:
        op["lane"] = "cpu"
        if op["kind"] in HOST_READS:  # the host's op reads them from the model itself, and only when needed
            op["inputs"] = op["inputs"][:1]
        op["inputs"] = [{"blob": r["tensor"]} if "tensor" in r else r for r in op["inputs"]]
        op["attrs"]["op"] = op["name"]
        point = N.hook_point(op["name"])
        if point:
            op["attrs"]["hook"] = point
        if op["kind"] == "linear":
            op["attrs"]["linear"] = op["name"]
    plan = validate({"ops": ops, "outputs": [ops[-1]["name"]]}, has_blob=lambda s: True, registry=registry)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = plan
    return plan


def run_float(plan, get, tokens: np.ndarray, session=None, host=None) -> np.ndarray:
    """Run a float_plan here: get: tensor name -> array, tokens int[batch * T] (sequence-major), session: the KV
    cache the run writes (.length, .write(layer, start, k, v)); host: what the plan's host ops read. -> the plan's
    output (float32[rows, vocab] or [rows, hidden]). An error a host callable raised is raised as it was."""
    ctx = HostContext(get=get, session=session, host=host)
    try:
        with host_pass():  # BLAS at one thread a call, the GEMMs spread over the policy's count: the same bits always
            outs = run_untraced(plan, {"tokens": tokens}, ctx)
    except HostRaised as e:
        raise e.error.with_traceback(e.error.__traceback__) from None
    return outs[plan.outputs[0]]


def run_float_part(plan, names, tokens: np.ndarray, ctx: HostContext, results: dict, unread: dict) -> None:
    """run_float for some of a float_plan's ops (`names`, in plan order), into `results` {op: array} with `unread`
    counts kept across parts (executor.run_ops): the host's layer-major pass runs one layer's ops for each window in
    turn, each window with its own results and unread. An error a host callable raised is raised as it was."""
    try:
        run_ops(plan, names, {"tokens": tokens}, ctx, results, unread)
    except HostRaised as e:
        raise e.error.with_traceback(e.error.__traceback__) from None
