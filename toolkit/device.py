"""The host side of the device agent: connect (local subprocess, URL or SSH), upload, plan, run, trace.

    with Device.local() as dev:                     # an agent subprocess on a free loopback port
        dev.upload(qm)                               # only the blobs the agent lacks, chunked, resumable
        res = dev.prefill(qm, tokens)                # logits of the last token + a Trace
Every call waits for exactly one final reply; while waiting it expects the agent's progress or
heartbeat messages and raises AgentLostError after HEARTBEAT_TIMEOUT_S of silence — never hangs.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from edgeprobe_agent.protocol import (CHUNK_BYTES, HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, PROTOCOL_VERSION, pack,
                                      unpack)

from .errors import EdgeprobeError
from .trace import Trace


class DeviceError(EdgeprobeError, RuntimeError):
    """The agent answered a request with an error; `code` names it (see docs/protocol.md)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{message} [{code}]")
        self.code = code


class AgentLostError(EdgeprobeError, ConnectionError):
    """The agent stopped answering (killed, network cut) within the heartbeat timeout."""


@dataclass
class RunResult:
    outputs: dict
    trace: Trace
    counters: dict = field(default_factory=dict)
    wall_s: float = 0.0
    schedule: object = None  # the Schedule a chunked prefill was laid out by (its predicted times)

    @property
    def logits(self) -> np.ndarray:
        return next(iter(self.outputs.values()))


def sample(logits: np.ndarray, temperature: float, rng) -> np.ndarray:
    """logits float[B, vocab] -> int64[B]: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature <= 0:
        return np.argmax(logits, axis=-1)
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    u = rng.random((p.shape[0], 1))
    return np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), p.shape[1] - 1)


@dataclass
class Decoded:
    """A decode session's result. tokens int64[batch, n] (the tokens fed to the n steps); logits: the
    prefill's float32[1, vocab], then each step's float32[batch, vocab]."""

    tokens: np.ndarray
    logits: list
    trace: Trace
    batch: int
    prefill_s: float
    decode_s: float          # wall time of the n steps, sampling and round trips included
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

    def __init__(self, dev: "Device", qm, capacity: int, name: str = "decode", progress: bool = True,
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
        from .plan import prefill_plan

        key = (n_tokens, batch)
        if key not in self._plans:
            split = self.split if n_tokens == 1 else None
            self._plans[key] = self.dev.put_plan(prefill_plan(self.qm.manifest, n_tokens, session=True, batch=batch,
                                                              split=split, ffn_flash=self.ffn_flash,
                                                              experts_flash=self.experts_flash))
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
        self.batch = self.dev.request("session_reorder", session=self.name, indices=[int(i) for i in indices])[0]["batch"]

    def step(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if len(tokens) != self.batch:
            raise ValueError(f"the session holds {self.batch} sequences; step needs one token for each, got {len(tokens)}")
        i = len(self.step_ms)
        r = self.dev.run(self._plan(1, self.batch), {"tokens": tokens}, title=f"decode step {i}", session=self.name,
                         advance=1, phase="decode")
        self.step_ms.append(r.trace.metrics()["makespan_ms"])
        self.step_counters.append({**r.counters, "flash_read_bytes": r.trace.metrics()["flash_read_bytes"]})
        self.events += [{**e, "group": f"step{i}"} for e in r.trace.events]
        self.length += 1
        return r.logits.reshape(self.batch, -1)

    def close(self) -> None:
        try:
            self.dev.request("close_session", session=self.name)
        except (DeviceError, AgentLostError):
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Device:
    def __init__(self, url: str, process: subprocess.Popen | None = None, timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 curve_server_key: bytes | None = None, tunnel=None):
        self.url, self.process, self.timeout_s, self.tunnel = url, process, timeout_s, tunnel
        self.temp_store = None  # a store folder this Device made and removes on close
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_server_key:
            pub, sec = zmq.curve_keypair()
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = pub, sec, curve_server_key
        self.sock.connect(url)
        self._ids = itertools.count(1)
        self.info = self.hello()
        self.clock_offset_us = self._align_clock()
        self.uploaded_bytes = 0

    # ---- ways to get one ----------------------------------------------------------------------
    @classmethod
    def local(cls, store: str | Path | None = None, memory_budget_mb: float | None = None,
              startup_timeout_s: float = 60.0, lanes=None, npu_backend: str | None = None) -> "Device":
        """Start `python -m edgeprobe_agent` on a free loopback port; close() stops it. npu_backend: numba | hvx
        (the npu lane's kernels: NPU semantics on this CPU, or Hexagon HVX code under qemu-hexagon)."""
        store = Path(store or os.environ.get("EDGEPROBE_AGENT_STORE")
                     or Path(tempfile.gettempdir()) / f"edgeprobe-agent-store-{os.getuid()}")
        cmd = [sys.executable, "-m", "edgeprobe_agent", "--bind", "tcp://127.0.0.1:*", "--store", str(store),
               "--parent-pid", str(os.getpid())]  # a killed host must not leave its agent holding the store
        if memory_budget_mb is not None:
            cmd += ["--memory-budget", str(memory_budget_mb)]
        if lanes is not None:
            cmd += ["--lanes", ",".join(lanes)]
        if npu_backend is not None:
            cmd += ["--npu-backend", npu_backend]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        url = _read_listen_line(proc, startup_timeout_s)
        return cls(url, process=proc)

    @classmethod
    def connect(cls, url: str, curve_server_key: bytes | None = None) -> "Device":
        return cls(url, curve_server_key=curve_server_key)

    @classmethod
    def ssh(cls, host: str, user: str, key_path, port: int = 22, python: str = "python3", known_hosts=None,
            host_fingerprint: str | None = None, remote_dir: str = "edgeprobe-agent", agent_port: int = 5555,
            progress: bool = True) -> "Device":
        """Deploy the agent over SSH to a phone (Termux sshd) or board and talk to it through a tunnel."""
        from .deploy import deploy_ssh

        tunnel = deploy_ssh(host, user, key_path, port=port, python=python, known_hosts=known_hosts,
                            host_fingerprint=host_fingerprint, remote_dir=remote_dir, agent_port=agent_port,
                            progress=progress)
        return cls(tunnel.local_url, tunnel=tunnel)

    # ---- requests -----------------------------------------------------------------------------
    def request(self, op: str, arrays=(), on_event=None, timeout_s: float | None = None, **fields) -> tuple[dict, list]:
        rid = self.send(op, arrays, **fields)
        return self.wait(rid, on_event, timeout_s)

    def send(self, op: str, arrays=(), **fields) -> int:
        rid = next(self._ids)
        self.sock.send_multipart(pack({"v": PROTOCOL_VERSION, "id": rid, "op": op, **fields}, arrays), copy=False)
        return rid

    def wait(self, rid: int, on_event=None, timeout_s: float | None = None) -> tuple[dict, list]:
        """Wait for request `rid`'s final reply; any message from the agent proves it alive."""
        timeout = timeout_s or self.timeout_s
        last = time.monotonic()
        last_ping = last
        while True:
            now = time.monotonic()
            if now - last_ping >= HEARTBEAT_S:  # our side of the heartbeat: the agent cancels runs of silent clients
                last_ping = now
                self.send("heartbeat")
            if self.sock.poll(int(HEARTBEAT_S * 1000)):
                header, arrays = unpack(self.sock.recv_multipart())
                last = time.monotonic()
                if header.get("id") != rid:
                    continue  # a reply to one of our heartbeats, or to an abandoned request
                if not header.get("final"):
                    if on_event:
                        on_event(header)
                    continue
                if not header.get("ok"):
                    err = header.get("error", {})
                    raise DeviceError(err.get("code", "?"), err.get("message", "the agent reported an error"))
                return header, arrays
            now = time.monotonic()
            if self.process is not None and self.process.poll() is not None:
                raise AgentLostError(f"the local agent exited with status {self.process.returncode}: "
                                     f"{(self.process.stderr.read() or '')[-500:]}")
            if now - last > timeout:
                raise AgentLostError(f"the agent at {self.url} sent nothing for {now - last:.1f} s (heartbeat timeout); "
                                     "it was killed or the connection was cut")

    def hello(self) -> dict:
        return self.request("hello")[0]

    def stats(self) -> dict:
        return self.request("stats")[0]

    def _align_clock(self, rounds: int = 5) -> float:
        """Agent clock - host clock (µs), from the hello/heartbeat round trip with the smallest RTT."""
        best = None
        for _ in range(rounds):
            t0 = time.perf_counter_ns() / 1e3
            h, _ = self.request("heartbeat")
            t1 = time.perf_counter_ns() / 1e3
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, h["clock_us"] - (t0 + t1) / 2)
        return best[1]

    # ---- upload ---------------------------------------------------------------------------------
    def upload(self, qm, progress: bool = True, chunk_bytes: int = CHUNK_BYTES, window: int = 8) -> int:
        """Send every blob of `qm` (a QuantizedModel) that the agent lacks; chunks it already holds from an
        interrupted upload are skipped. Returns the bytes sent."""
        from tqdm.auto import tqdm

        blobs = qm.manifest["blobs"]
        head, _ = self.request("has_blobs", ids=list(blobs))
        have, partial = set(head["have"]), head["partial"]
        todo = []
        for sha, meta in blobs.items():
            if sha in have:
                continue
            arr = qm.store.get(sha)
            raw = memoryview(np.ascontiguousarray(arr)).cast("B")
            n = max(1, -(-len(raw) // chunk_bytes))
            done = set(partial.get(sha, []))
            todo += [(sha, arr, raw, i, n) for i in range(n) if i not in done]
        total = sum(min(chunk_bytes, len(raw) - i * chunk_bytes) for _, _, raw, i, _ in todo)
        sent = 0
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="upload", disable=not progress or not total, leave=False)
        pending: list[int] = []
        for sha, arr, raw, i, n in todo:
            piece = np.frombuffer(raw[i * chunk_bytes:(i + 1) * chunk_bytes], np.uint8)
            pending.append(self.send("put_blob", [piece], sha=sha, dtype=arr.dtype.name, shape=list(arr.shape),
                                     nbytes=len(raw), chunk=i, n_chunks=n, chunk_bytes=chunk_bytes,
                                     chunk_crc32=zlib.crc32(piece)))
            sent += len(piece)
            bar.update(len(piece))
            if len(pending) >= window:  # a few chunks in flight keep the pipe full without unbounded memory
                self.wait(pending.pop(0))
        for rid in pending:
            self.wait(rid)
        bar.close()
        self.uploaded_bytes += sent
        return sent

    # ---- models, plans, runs --------------------------------------------------------------------
    def load_model(self, qm) -> str:
        return self.request("load_model", manifest=_plain(qm.manifest))[0]["model_id"]

    def put_plan(self, plan: dict) -> str:
        return self.request("put_plan", plan=_plain(plan))[0]["plan_id"]

    def run(self, plan_id: str, inputs: dict, on_progress=None, title: str = "", **fields) -> RunResult:
        """fields: session / advance / phase for a run inside a decode session (docs/protocol.md)."""
        t0 = time.perf_counter()
        names = list(inputs)
        head, arrays = self.request("run", [np.ascontiguousarray(inputs[n]) for n in names], on_event=on_progress,
                                    plan_id=plan_id, inputs=names, **fields)
        wall = time.perf_counter() - t0
        events = [{**e, "start_us": e["start_us"] - self.clock_offset_us, "end_us": e["end_us"] - self.clock_offset_us}
                  for e in head["events"]]
        meta = {"title": title or "edgeprobe agent run", "agent": self.info.get("agent_version"), "url": self.url,
                "clock_offset_us": self.clock_offset_us, "counters": head.get("counters", {})}
        return RunResult(dict(zip(head["outputs"], arrays)), Trace(events, meta), head.get("counters", {}), wall)

    def prefill(self, qm, tokens, progress: bool = True, float_lane: str = "cpu") -> RunResult:
        """Upload what is missing, send the prefill plan, run it: logits of the last token + the trace."""
        from .plan import prefill_plan

        tokens = np.asarray(tokens, np.int32)
        self.upload(qm, progress=progress)
        self.load_model(qm)
        plan_id = self.put_plan(prefill_plan(qm.manifest, len(tokens), float_lane=float_lane))
        return self.run(plan_id, {"tokens": tokens}, title=f"prefill {len(tokens)} tokens, {qm.scheme}")

    def prefill_chunked(self, qm, tokens, chunk: int = 256, scheduler: str = "ooo",
                        profile="this-host-emulated", progress: bool = True) -> RunResult:
        """Chunked prefill (mllm-NPU §3.2) laid out by a scheduler (§3.4) over `profile`: a named modelled
        profile, a measured profile's .json, or a profile object (e.g. from `measure_profile`)."""
        from .models import ModelConfig
        from .plan import chunked_prefill_plan, shadow_layers
        from .schedule import chunk_graph, device_profile, schedule

        tokens = np.asarray(tokens, np.int32)
        graph = chunk_graph(ModelConfig(**qm.manifest["config"]), len(tokens), chunk, shadow=shadow_layers(qm.manifest))
        sched = schedule(graph, device_profile(profile), scheduler)
        lacking = {g.lane for g in sched.graph.subgraphs} - set(self.info.get("lanes", []))
        if lacking:
            from .schedule import ScheduleError
            raise ScheduleError(f"the schedule puts work on lanes {sorted(lacking)} that this agent lacks "
                                f"(it has {self.info.get('lanes')})")
        self.upload(qm, progress=progress)
        self.load_model(qm)
        plan_id = self.put_plan(chunked_prefill_plan(qm.manifest, sched))
        res = self.run(plan_id, {"tokens": tokens}, title=f"chunked prefill {len(tokens)} tokens / {chunk}, {scheduler}")
        res.trace.meta["predicted_makespan_ms"] = sched.makespan_us / 1e3
        res.schedule = sched
        return res

    def session(self, qm, capacity: int, name: str = "decode", progress: bool = True, split=None,
                ffn_flash=None, experts_flash=None) -> "DecodeSession":
        """A decode session on the agent (KV cache kept there): prefill, reorder (fork / beams), step."""
        return DecodeSession(self, qm, capacity, name, progress, split, ffn_flash, experts_flash)

    def generate(self, qm, prompt, n: int, batch: int = 1, temperature: float = 0.0, seed: int = 0,
                 on_step=None, progress: bool = True, split=None, ffn_flash=None, experts_flash=None) -> "Decoded":
        """Prefill `prompt` (token ids) once, fork it into `batch` sequences, then run `n` decode steps on the
        agent, its KV cache staying there. Each step feeds every sequence its next token, sampled on the host
        from the previous logits (greedy at temperature 0, else softmax(z / T) with `seed`), and gets
        float32[batch, vocab] logits back. on_step(i, tokens[batch]) streams the tokens. The trace groups
        events by "prefill" and "step{i}". split: HeteroLLM's partition of the decode steps' int8 GEMMs
        between the gpu and npu lanes ({matmul: Choice}, schedule.hetero.decode_choices). ffn_flash: FFN neurons
        read from flash ({"mode": "sparse" | "dense", "window": k}; needs neurons.add_bundles). experts_flash:
        MoE experts read from flash through an expert buffer ({"capacity", "policy", "preload_n"}; EdgeMoE)."""
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        if n < 1 or batch < 1:
            raise ValueError(f"n (decode steps) and batch must be >= 1, got n={n}, batch={batch}")
        rng = np.random.default_rng(seed)
        with self.session(qm, len(prompt) + n, progress=progress, split=split, ffn_flash=ffn_flash,
                          experts_flash=experts_flash) as s:
            t0 = time.perf_counter()
            logits = s.prefill(prompt)
            t1 = time.perf_counter()
            if batch > 1:
                s.reorder([0] * batch)
            logits = np.repeat(logits, batch, axis=0)
            fed, all_logits = [], [s.logits_history[0]]
            for i in range(n):
                tok = sample(logits, temperature, rng)
                fed.append(tok)
                if on_step:
                    on_step(i, tok)
                logits = s.step(tok)
                all_logits.append(logits)
            t2 = time.perf_counter()
        meta = {**s.meta, "title": f"prefill {len(prompt)} + {n} decode steps x batch {batch}, {qm.scheme}"}
        return Decoded(np.stack(fed, axis=1), all_logits, Trace(s.events, meta), batch, t1 - t0, t2 - t1, s.step_ms,
                       s.step_counters)

    def measure_linears(self, qm, rows=(32, 64, 128, 256, 512, 1024), progress: bool = True):
        """HeteroLLM's profiler on this agent: int8 GEMM rates of the npu and gpu lanes and their hand-off,
        as a HeteroProfile for the partition solver (and the samples). See schedule.measure."""
        from .schedule.measure import measure_linears

        return measure_linears(self, qm, rows, progress=progress)

    def prefill_hetero(self, qm, tokens, profile, strategy: str = "solver", progress: bool = True) -> RunResult:
        """Layer-by-layer prefill with every int8 GEMM partitioned between the gpu and npu lanes by HeteroLLM's
        solver over `profile` (a HeteroProfile; measure one with measure_linears), or by one fixed strategy
        (gpu, npu-pad, pipe, seq-cut, row-cut) as a baseline."""
        from .plan import prefill_plan
        from .models import ModelConfig
        from .schedule import ScheduleError, choices_for

        tokens = np.asarray(tokens, np.int32)
        lacking = {"gpu", "npu"} - set(self.info.get("lanes", []))
        if lacking:
            raise ScheduleError(f"HeteroLLM partitioning puts work on lanes {sorted(lacking)} that this agent lacks "
                                f"(it has {self.info.get('lanes')}; the gpu lane needs OpenCL)")
        choices = choices_for(ModelConfig(**qm.manifest["config"]), len(tokens), profile, strategy)
        self.upload(qm, progress=progress)
        self.load_model(qm)
        try:
            plan = prefill_plan(qm.manifest, len(tokens), split=choices)
        except ValueError as e:
            raise ScheduleError(str(e)) from None
        res = self.run(self.put_plan(plan), {"tokens": tokens}, title=f"prefill {len(tokens)} tokens, HeteroLLM {strategy}")
        res.trace.meta["partition"] = {k: c.strategy for k, c in choices.items()}
        res.trace.meta["predicted_matmul_ms"] = sum(c.time_us for c in choices.values()) * qm.manifest["config"]["n_layers"] / 1e3
        return res

    def measure_profile(self, qm, tokens, chunks=(64, 128, 256), n_chunks: int = 3, progress: bool = True):
        """Subgraph times of `qm` measured on this agent over a grid of chunk lengths: a MeasuredProfile
        (HeteroLLM's "predicted" mode; `.with_mode("real")` for the measured table). See schedule.measure."""
        from .schedule.measure import measure_profile

        return measure_profile(self, qm, tokens, chunks, n_chunks, progress)

    def close(self, shutdown: bool | None = None) -> None:
        """Say bye (and stop the agent if this Device started it)."""
        stop = self.process is not None if shutdown is None else shutdown
        try:
            if self.sock.closed is False:
                self.request("bye", timeout_s=2.0, shutdown=bool(stop))
        except Exception:
            pass
        self.sock.close(0)
        if self.process is not None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self.tunnel is not None:
            self.tunnel.close()
        if self.temp_store is not None:
            import shutil

            shutil.rmtree(self.temp_store, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_listen_line(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline()
            if "listening on " in line:
                return line.strip().split("listening on ", 1)[1]
        if proc.poll() is not None:
            raise DeviceError("agent_start", f"the local agent exited at start: {proc.stderr.read()[-800:]}")
    proc.kill()
    raise DeviceError("agent_start", f"the local agent did not report its address within {timeout_s:.0f} s")


def _plain(v):
    """numpy scalars/arrays and tuples -> msgpack-able Python values."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v
