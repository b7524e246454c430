"""Workflows on top of the thin client (client.py): prefill, chunked prefill, HeteroLLM prefill, decode
sessions and generation, and the measurements that feed the cost models.

Each function takes a connected client first (`dev`) and uses only its public calls (upload, load_model,
put_plan, run, request, info); `edgeprobe.device.Device` attaches them as methods, so `dev.prefill(qm, toks)`
is `workflows.prefill(dev, qm, toks)`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .client import Client, RunResult
from .errors import AgentLostError, DeviceError
from .sampling import sample
from .trace import Trace, flash_read_bytes, span_of


@dataclass
class Decoded:
    """A decode session's result. tokens int64[batch, n] (the tokens fed to the n steps); logits: the
    prefill's float32[1, vocab], then each step's float32[batch, vocab] (the last step's only, with
    generate(logits="last"))."""

    tokens: np.ndarray
    logits: list
    trace: Trace
    batch: int
    prefill_s: float
    decode_s: float          # wall time of the n steps, sampling and round trips included (fork and plan before)
    step_ms: list            # each step's makespan on the agent
    step_counters: list = field(default_factory=list)  # each step's counters (+ flash_read_bytes)

    @property
    def decode_tok_per_s(self) -> float:
        """Tokens per second summed over the batch (wall time on the host)."""
        return self.tokens.size / self.decode_s if self.decode_s > 0 else float("nan")


class DecodeSession:
    """A KV cache kept on the agent across runs (protocol: open_session / run with session / session_reorder).

    prefill(tokens int[T]) -> float32[1, vocab]; reorder(indices) keeps / copies sequences (batch = len);
    step(tokens int[batch]) -> float32[batch, vocab]. `events` gathers every run's trace events, grouped
    "prefill" / "step{i}"; `step_ms` each step's makespan. The same interface as generate.HostSession."""

    def __init__(self, dev: Client, qm, capacity: int, name: str = "decode", progress: bool = True,
                 split: dict | None = None, ffn_flash: dict | None = None, experts_flash: dict | None = None):
        c = qm.manifest["config"]
        if capacity > c["context_length"]:
            raise ValueError(f"{capacity} positions exceed the model's context length {c['context_length']}")
        self.dev, self.qm, self.name = dev, qm, name
        dev.upload(qm, progress=progress)
        self.model_id = dev.load_model(qm)
        dev.request("open_session", model_id=self.model_id, session=name, batch=1, capacity=capacity)
        self.batch, self.length, self.events, self.step_ms, self.logits_history = 1, 0, [], [], []
        self._plans: dict = {}
        self.meta: dict = {}
        self.split = split  # HeteroLLM partition of the decode steps' int8 GEMMs (schedule.hetero.choices_for)
        self.ffn_flash = ffn_flash  # LLM in a flash: FFN neurons from flash ({"mode", "window"})
        self.experts_flash = experts_flash  # EdgeMoE: experts from flash ({"capacity", "policy", "preload_n"})
        self.step_counters: list = []

    def _plan(self, n_tokens: int, batch: int) -> str:
        from .plan import one_lane_for, prefill_plan

        key = (n_tokens, batch)
        if key not in self._plans:
            split = self.split if n_tokens == 1 else None
            self._plans[key] = self.dev.put_plan(prefill_plan(self.qm.manifest, n_tokens, session=True, batch=batch,
                                                              split=split, ffn_flash=self.ffn_flash,
                                                              experts_flash=self.experts_flash,
                                                              one_lane=one_lane_for(self.dev.info)))
        return self._plans[key]

    def prefill(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if len(tokens) == 0:
            raise ValueError("the prompt is empty; give at least one token")
        r = self.dev.run(self._plan(len(tokens), 1), {"tokens": tokens}, title="prefill", session=self.name,
                         advance=len(tokens), phase="prefill")
        self.meta = dict(r.trace.meta)
        self.events += [{**e, "group": "prefill"} for e in r.trace.events]
        self.length += len(tokens)
        self.logits_history.append(r.logits.reshape(1, -1))
        return self.logits_history[-1]

    def reorder(self, indices) -> None:
        reply = self.dev.request("session_reorder", session=self.name, indices=[int(i) for i in indices])[0]
        self.batch = reply["batch"]

    def step(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if len(tokens) != self.batch:
            raise ValueError(f"the session holds {self.batch} sequences; step needs one token for each, "
                             f"got {len(tokens)}")
        i = len(self.step_ms)
        r = self.dev.run(self._plan(1, self.batch), {"tokens": tokens}, title=f"decode step {i}", session=self.name,
                         advance=1, phase="decode")
        self._record(r.trace.events, i, r.counters)
        self.length += 1
        return r.logits.reshape(self.batch, -1)

    def greedy(self, tokens, n: int, keep: str = "all") -> tuple[np.ndarray, list]:
        """n decode steps in one run, the loop on the agent: step 0 is fed tokens int[batch], each later step the
        argmax of the step before's logits, computed there (no round trip per token: a phone's runtime loops
        in-process too). -> (fed int32[batch, n], logits: each step's float32[batch, vocab], or only the last
        step's with keep="last"). The steps join `events` ("step{i}"), `step_ms` and `step_counters` as if sent
        one by one, and their bits are the same."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if len(tokens) != self.batch:
            raise ValueError(f"the session holds {self.batch} sequences; step needs one token for each, "
                             f"got {len(tokens)}")
        if n < 1:
            raise ValueError(f"n (decode steps) must be >= 1, got {n}")
        i0 = len(self.step_ms)
        r = self.dev.run(self._plan(1, self.batch), {"tokens": tokens}, title=f"decode steps {i0}..{i0 + n - 1}",
                         session=self.name, advance=1, phase="decode", steps=n, keep=keep)
        by_step: dict = {i: [] for i in range(n)}
        for e in r.trace.events:
            by_step[e.get("step", n - 1)].append(e)  # reads still in flight at the loop's end: the last step's
        for i, evs in by_step.items():  # as step() records one step
            self._record(evs, i0 + i, r.step_counters[i])
        self.length += n
        return r.outputs["fed"], list(r.logits) if keep == "all" else [r.logits]

    def _record(self, events: list, i: int, counters: dict) -> None:
        """Keep step i's events (their group becomes "step{i}"; the run's own event dicts, changed in place: a
        decode loop's per-token time outside the ops counts this), its makespan and counters."""
        self.step_ms.append(span_of(events)[0] / 1e3 if events else 0.0)
        self.step_counters.append({**counters, "flash_read_bytes": flash_read_bytes(events)})
        for e in events:
            e["group"] = f"step{i}"
        self.events += events

    def close(self) -> None:
        try:
            self.dev.request("close_session", session=self.name)
        except (DeviceError, AgentLostError):
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def prefill(dev: Client, qm, tokens, progress: bool = True, float_lane: str = "cpu") -> RunResult:
    """Upload what is missing, send the prefill plan, run it: logits of the last token + the trace."""
    from .plan import prefill_plan

    tokens = np.asarray(tokens, np.int32)
    return _run_plan(dev, qm, ("prefill", len(tokens), float_lane),
                     lambda: prefill_plan(qm.manifest, len(tokens), float_lane=float_lane),
                     {"tokens": tokens}, f"prefill {len(tokens)} tokens, {qm.scheme}", progress)


# what an agent answers when it lacks what the client remembered it holding (a new agent behind the same address)
_FORGOTTEN = {"unknown_plan", "unknown_model", "missing_blob"}


def _run_plan(dev: Client, qm, key, build, inputs: dict, title: str, progress: bool) -> RunResult:
    """Upload what is missing, load qm, put build()'s plan (each once per connection: Client.plan_for) and run it."""
    for attempt in (0, 1):
        plan_id = dev.plan_for(qm, key, build, progress=progress)  # uploads what is missing
        try:
            return dev.run(plan_id, inputs, title=title)
        except DeviceError as e:
            if e.code not in _FORGOTTEN or attempt:
                raise
            dev.forget()  # and once more from the start


def prefill_chunked(dev: Client, qm, tokens, chunk: int = 256, scheduler: str = "ooo",
                    cost_model="this-host-emulated", progress: bool = True, *, profile=None,
                    numerics: dict | None = None) -> RunResult:
    """Chunked prefill (mllm-NPU §3.2) laid out by a scheduler (§3.4) over `cost_model`: a named modelled
    cost model, a measured one's .json, or a cost model object (e.g. from `measure_cost_model`). profile: the
    old name of cost_model. numerics: capture each chunk's ops and compare them with the host's same chunk
    ({} for every op, or numerics.plan_numerics' keywords: ops, full, float_model, tolerance, ...): res.numerics."""
    from .plan import chunked_prefill_plan
    from .schedule import cost_model as named
    from .schedule.predict import predicted_schedule

    tokens = np.asarray(tokens, np.int32)
    graph, sched = predicted_schedule(qm.manifest, len(tokens), chunk, scheduler,
                                      named(cost_model if profile is None else profile))
    lacking = {g.lane for g in sched.graph.subgraphs} - set(dev.info.get("lanes", []))
    if lacking:
        from .schedule import ScheduleError
        raise ScheduleError(f"the schedule puts work on lanes {sorted(lacking)} that this agent lacks "
                            f"(it has {dev.info.get('lanes')})")
    dev.upload(qm, progress=progress)
    dev.load_model(qm)
    plan = chunked_prefill_plan(qm.manifest, sched)
    title = f"chunked prefill {len(tokens)} tokens / {chunk}, {scheduler}"
    res = _run_put(dev, qm, plan, tokens, title, numerics)
    res.trace.meta["predicted_makespan_ms"] = sched.makespan_us / 1e3
    res.schedule = sched
    return res


def _run_put(dev: Client, qm, plan: dict, tokens, title: str, numerics: dict | None) -> RunResult:
    """Put a scheduled prefill plan and run it; with numerics (plan_numerics' keywords), captured and compared with
    the host."""
    if numerics is None:
        return dev.run(dev.put_plan(plan), {"tokens": tokens}, title=title)
    from .numerics import plan_numerics

    return plan_numerics(dev, qm, plan, tokens, title=f"{title}, numerics captured", **numerics)


def session(dev: Client, qm, capacity: int, name: str = "decode", progress: bool = True, split=None,
            ffn_flash=None, experts_flash=None) -> DecodeSession:
    """A decode session on the agent (KV cache kept there): prefill, reorder (fork / beams), step."""
    return DecodeSession(dev, qm, capacity, name, progress, split, ffn_flash, experts_flash)


def generate(dev: Client, qm, prompt, n: int, batch: int = 1, temperature: float = 0.0, seed: int = 0,
             on_step=None, progress: bool = True, split=None, ffn_flash=None, experts_flash=None,
             loop: str = "host", logits: str = "all") -> Decoded:
    """Prefill `prompt` (int token ids) once, fork it into `batch` sequences, then run `n` decode steps on the
    agent, its KV cache staying there. Each step feeds every sequence its next token, sampled on the host
    from the previous logits (greedy at temperature 0, else softmax(z / T) with `seed`), and gets
    float32[batch, vocab] logits back. on_step(i, tokens[batch]) streams the tokens; the trace groups
    events by "prefill" and "step{i}".
    split: HeteroLLM's partition of the decode steps' int8 GEMMs between the gpu and npu lanes
    ({matmul: Choice}, schedule.hetero.decode_choices). ffn_flash: FFN neurons read from flash (LLM in a flash;
    {"mode": "sparse" | "dense", "window": k}, needs neurons.add_bundles). experts_flash: MoE experts read from
    flash through an expert buffer (EdgeMoE; {"capacity", "policy", "preload_n"}).
    loop="agent" (greedy only): the agent loops over the n steps itself (DecodeSession.greedy), one round trip
    for all of them with the same tokens and logits, as a phone's runtime loops in-process; on_step then runs
    after the loop. logits="last": keep only the prefill's and the last step's logits, so a loop on the agent
    sends back one step's logits instead of n."""
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if n < 1 or batch < 1:
        raise ValueError(f"n (decode steps) and batch must be >= 1, got n={n}, batch={batch}")
    if loop not in ("host", "agent"):
        raise ValueError(f"loop must be 'host' (the host samples each token) or 'agent' (greedy on the agent), "
                         f"got {loop!r}")
    if logits not in ("all", "last"):
        raise ValueError(f"logits must be 'all' (every step's) or 'last' (the last step's), got {logits!r}")
    if loop == "agent" and temperature > 0:
        raise ValueError(f"the agent's decode loop is greedy; sampling at temperature {temperature} needs loop='host'")
    rng, logits_kept = np.random.default_rng(seed), logits
    with session(dev, qm, len(prompt) + n, progress=progress, split=split, ffn_flash=ffn_flash,
                 experts_flash=experts_flash) as s:
        t0 = time.perf_counter()
        logits = s.prefill(prompt)
        t1 = time.perf_counter()
        if batch > 1:
            s.reorder([0] * batch)
        s._plan(1, batch)  # the steps' plan is put once per session, before the clock of the steps starts
        t1d = time.perf_counter()
        logits = np.repeat(logits, batch, axis=0)
        fed, all_logits = [], [s.logits_history[0]]
        if loop == "agent":
            tokens, steps = s.greedy(sample(logits, 0.0, rng), n, keep=logits_kept)
            fed, all_logits = list(tokens.T.astype(np.int64)), all_logits + steps
        for i in range(n):
            if loop == "host":
                fed.append(sample(logits, temperature, rng))
            if on_step:
                on_step(i, fed[i])
            if loop == "host":
                logits = s.step(fed[i])
                all_logits.append(logits)
        t2 = time.perf_counter()
    if logits_kept == "last":
        all_logits = [all_logits[0], all_logits[-1]]
    meta = {**s.meta, "title": f"prefill {len(prompt)} + {n} decode steps x batch {batch}, {qm.scheme}"}
    return Decoded(np.stack(fed, axis=1), all_logits, Trace(s.events, meta), batch, t1 - t0, t2 - t1d, s.step_ms,
                   s.step_counters)


def measure_linears(dev: Client, qm, rows=(32, 64, 128, 256, 512, 1024), progress: bool = True):
    """HeteroLLM's profiler on this agent: int8 GEMM rates of the npu and gpu lanes and their hand-off,
    as a HeteroCostModel for the partition solver (and the samples). See schedule.measure."""
    from .schedule.measure import measure_linears as measure

    return measure(dev, qm, rows, progress=progress)


def prefill_hetero(dev: Client, qm, tokens, cost_model=None, strategy: str = "solver", progress: bool = True, *,
                   profile=None, numerics: dict | None = None) -> RunResult:
    """Layer-by-layer prefill with every int8 GEMM partitioned between the gpu and npu lanes by HeteroLLM's
    solver over `cost_model` (a HeteroCostModel; measure one with measure_linears), or by one fixed strategy
    (gpu, npu-pad, pipe, seq-cut, row-cut) as a baseline. profile: the old name of cost_model. numerics: capture
    the split linears' pieces and joins and every other op, compared with the host (as prefill_chunked's)."""
    from .models import ModelConfig
    from .plan import prefill_plan
    from .schedule import ScheduleError, choices_for

    tokens = np.asarray(tokens, np.int32)
    lacking = {"gpu", "npu"} - set(dev.info.get("lanes", []))
    if lacking:
        raise ScheduleError(f"HeteroLLM partitioning puts work on lanes {sorted(lacking)} that this agent lacks "
                            f"(it has {dev.info.get('lanes')}; the gpu lane needs OpenCL)")
    cost_model = cost_model if profile is None else profile
    if cost_model is None:
        raise TypeError("prefill_hetero needs a HeteroCostModel (measure one with measure_linears)")
    choices = choices_for(ModelConfig(**qm.manifest["config"]), len(tokens), cost_model, strategy)
    dev.upload(qm, progress=progress)
    dev.load_model(qm)
    try:
        plan = prefill_plan(qm.manifest, len(tokens), split=choices)
    except ValueError as e:
        raise ScheduleError(str(e)) from None
    res = _run_put(dev, qm, plan, tokens, f"prefill {len(tokens)} tokens, HeteroLLM {strategy}", numerics)
    res.trace.meta["partition"] = {k: c.strategy for k, c in choices.items()}
    layers = qm.manifest["config"]["n_layers"]
    res.trace.meta["predicted_matmul_ms"] = sum(c.time_us for c in choices.values()) * layers / 1e3
    return res


def measure_cost_model(dev: Client, qm, tokens, chunks=(64, 128, 256), n_chunks: int = 3, progress: bool = True,
                       rounds: int = 2):
    """Subgraph times of `qm` measured on this agent over a grid of chunk lengths: a MeasuredCostModel
    (HeteroLLM's "predicted" mode; `.with_mode("real")` for the measured table). See schedule.measure."""
    from .schedule.measure import measure_cost_model as measure

    return measure(dev, qm, tokens, chunks, n_chunks, progress, rounds)


measure_profile = measure_cost_model  # the old name, kept for code written against it


def host_logits(qm, tokens, chunk: int | None = None) -> np.ndarray:
    """The host's simulation of what the agent ran on `qm`: float32 logits of the last token, from one pass
    (chunk None) or chunk by chunk through a KV cache, as a chunked prefill runs (a quantized model's rounding
    makes the two differ slightly, so compare like with like). tokens: int[T]."""
    from .forward import KVCache, forward

    if not chunk:
        return qm.forward(tokens, logits="last")
    cache = KVCache(qm.model.config)
    for i in range(0, len(tokens), chunk):
        out = forward(qm.model, tokens[i:i + chunk], cache=cache, linear=qm.linear, logits="last")
    return out
