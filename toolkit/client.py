"""The thin client of the device agent, like TVM's RPC session: request, send/wait, upload, load_model,
put_plan, run, heartbeat and clock alignment, close. Ways to get one: `Client.local()` (an agent subprocess
on a free loopback port, started by local_agent.py), `Client.connect(url)`, `Client.ssh(...)` (deploy over SSH,
talk through a tunnel).

Every call waits for exactly one final reply under its request's id; while waiting it expects the agent's
progress or heartbeat messages and raises AgentLostError after HEARTBEAT_TIMEOUT_S of silence — never hangs.
An error reply becomes a DeviceError at once. The workflows (prefill, chunked, hetero, generate, measure)
sit on top of this in workflows.py; `edgeprobe.device.Device` is this client with them attached.
"""
from __future__ import annotations

import itertools
import shutil
import socket
import subprocess
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from edgeprobe_agent.protocol import (
    CHUNK_BYTES,
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    NO_ID,
    PROTOCOL_VERSION,
    crc32,
    pack,
    unpack,
)

from . import local_agent
from .errors import AgentLostError, AgentUnreachableError, DeviceError, NotAnAgentError
from .local_agent import EMULATED_TIMEOUT_S, STDERR_TAIL_BYTES, StderrTail, exit_note, stderr_note
from .probe import first_bytes
from .trace import Trace

STOP_WAIT_S = 60.0  # how long close() waits for the agent it started to stop before killing it

# importable from here as before: the errors (errors.py) and the local agent's stderr tail (local_agent.py)
__all__ = ["Client", "RunResult", "DeviceError", "AgentLostError", "AgentUnreachableError", "NotAnAgentError",
           "StderrTail", "STDERR_TAIL_BYTES", "EMULATED_TIMEOUT_S", "probe_agent"]

PROBE_TIMEOUT_S = 3.0  # connect, then wait for the peer's ZeroMQ greeting (libzmq sends it at once, busy or not)
ZMTP_SIGNATURE = (b"\xff", b"\x7f")  # a ZMTP 3 greeting's first byte and its 10th (RFC 23)


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: another machine as far as the hint goes


def probe_agent(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise AgentUnreachableError when nothing listens at a tcp:// url, NotAnAgentError when what listens there sends
    no ZeroMQ greeting. ZeroMQ connects lazily and retries in the background, so without this a wrong address looks
    like an agent that died after a heartbeat timeout. The agent's own handshake (hello) follows as before."""
    if not url.startswith("tcp://"):
        return  # ipc:// has no port to probe; ZeroMQ reports its own errors there
    host, _, port = url[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    try:
        port_n = int(port)
    except ValueError:
        return  # a form ZeroMQ parses itself (an interface name, a wildcard)
    # only what works from `edgeprobe run`: an agent off loopback needs CURVE keys, which only the Python API passes
    start = (f"start one (`edgeprobe agent --bind tcp://127.0.0.1:{port_n}`) or use --device local"
             if _loopback(host) else
             "an agent on another machine listens on its loopback: reach it with --device ssh://USER@HOST (which "
             "starts the agent and tunnels to it), or use --device local")
    try:
        sock = socket.create_connection((host, port_n), timeout=timeout_s)
    except ConnectionRefusedError:
        raise AgentUnreachableError(f"nothing is listening at {url} (connection refused): no agent is running there; "
                                    f"{start}") from None
    except socket.timeout:
        raise AgentUnreachableError(f"cannot reach {url}: no answer to a TCP connect within {timeout_s:g} s (a wrong "
                                    f"host, or a firewall); {start}") from None
    except OSError as e:
        raise AgentUnreachableError(f"cannot reach {url} ({e.strerror or e}); {start}") from None
    with sock:
        got, closed = first_bytes(sock, lambda got: len(got) >= 10, 64, timeout_s)
    if len(got) >= 10 and got[:1] == ZMTP_SIGNATURE[0] and got[9:10] == ZMTP_SIGNATURE[1]:
        return
    said = got.decode("latin-1").strip().splitlines()[0][:60] if got.strip() else ""
    what = (f"it answered {said!r}" if said else "it closed the connection without a ZeroMQ greeting" if closed
            else f"it sent no ZeroMQ greeting within {timeout_s:g} s")
    raise NotAnAgentError(f"{url} is not an edgeprobe agent: something listens there but {what}; give the address an "
                          "`edgeprobe agent --bind ...` printed, or use --device local")


@dataclass
class RunResult:
    outputs: dict
    trace: Trace
    counters: dict = field(default_factory=dict)
    wall_s: float = 0.0
    schedule: object = None  # the Schedule a chunked prefill was laid out by (its predicted times)
    step_counters: list = field(default_factory=list)  # a decode loop's counters, one dict per step
    numerics: object = None  # per-op numerics (edgeprobe.numerics): a NumericsReport, a DecodeNumerics for a session
    numerics_raw: tuple | None = None  # (the reply's "numerics" map, its full tensors): what the report compares

    @property
    def logits(self) -> np.ndarray:
        return next(iter(self.outputs.values()))


class Client:
    def __init__(self, url: str, process: subprocess.Popen | None = None, timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 curve_server_key: bytes | None = None, tunnel=None, stderr: StderrTail | None = None):
        self.url, self.process, self.timeout_s, self.tunnel = url, process, timeout_s, tunnel
        self.stderr = stderr  # a local agent's stderr tail
        self.temp_store = None  # a store folder this client made and removes on close
        self.store = None  # a local agent's store folder (its flash)
        self.local_options: dict | None = None  # how Client.local started it, so a closed one can be started again
        self.agent_path = None  # the folder an emulated local agent imported its packages from (removed on close)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_server_key:
            pub, sec = zmq.curve_keypair()
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = pub, sec, curve_server_key
        if process is None and tunnel is None:  # an address the user gave: is an agent there at all?
            try:
                probe_agent(url)
            except BaseException:
                self.sock.close(0)
                raise
        self.sock.connect(url)
        self._ids = itertools.count(1)
        self.info = self.hello()
        self.clock_offset_us = self._align_clock()
        self.uploaded_bytes = 0
        # id(qm) -> {"ref", "manifest", "model_id", "plans"}: what this connection's agent already holds of a model
        # (the agent never drops blobs, models or plans it accepted); forget() clears it
        self._known: dict[int, dict] = {}

    # ---- ways to get one ----------------------------------------------------------------------
    @classmethod
    def local(cls, store: str | Path | None = None, memory_budget_mb: float | None = None,
              startup_timeout_s: float | None = None, lanes=None, npu_backend: str | None = None, say=None,
              arch: str | None = None):
        """Start `python -m edgeprobe_agent` on a free loopback port; close() stops it. npu_backend: numba | hvx
        (the npu lane's kernels: NPU semantics on this CPU, or Hexagon HVX code under qemu-hexagon). arch: None (this
        machine) or "arm64": the agent runs in Debian's arm64 Python under qemu-aarch64, without numba, as on a phone
        (arm64.py; its own default store). startup_timeout_s: how long it may take to print its address (None: 60 s,
        180 s under qemu-aarch64).

        store: the agent's flash. Given, it is used as is (another agent holding it is an error). Left out, it is
        $EDGEPROBE_AGENT_STORE or <edgeprobe cache>/agent-store[-arm64]; when another agent holds that one (a
        notebook, a second `edgeprobe run`), the first free sibling <store>-2, <store>-3, ... is used and `say`
        (default: a line on stderr) tells which."""
        agent = local_agent.start(store, memory_budget_mb, startup_timeout_s, lanes, npu_backend, say, arch)
        try:
            client = cls(agent.url, process=agent.process, stderr=agent.stderr, timeout_s=agent.timeout_s)
        except BaseException:
            agent.kill()  # no client holds it: it must not outlive this failed start
            raise
        client.store, client.local_options, client.agent_path = agent.store, agent.options, agent.agent_path
        return client

    @property
    def closed(self) -> bool:
        """True once close() ran (or the socket is gone): requests would fail with a raw ZeroMQ error."""
        return self.sock.closed

    @classmethod
    def connect(cls, url: str, curve_server_key: bytes | None = None):
        return cls(url, curve_server_key=curve_server_key)

    @classmethod
    def ssh(cls, host: str, user: str, key_path, port: int = 22, python: str = "python3", known_hosts=None,
            host_fingerprint: str | None = None, remote_dir: str = "edgeprobe-agent", agent_port: int = 5555,
            progress: bool = True):
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
        """Wait for request `rid`'s final reply; any message from the agent proves it alive. An error reply
        under `rid` raises DeviceError at once; so does one under id -1 (the agent could not read some request
        of ours, and would never answer it under its id)."""
        return self.wait_any({rid}, on_event, timeout_s)[1:]

    def wait_all(self, rids, timeout_s: float | None = None) -> dict:
        """{rid: (header, arrays) or the DeviceError it was answered with} once every request in `rids` has its final
        reply (requests sent together, whose replies come in any order: wait() would drop the others' replies)."""
        out, left = {}, set(rids)
        while left:
            rid, header, arrays = self.wait_any(left, timeout_s=timeout_s, errors=True)
            out[rid] = header if isinstance(header, DeviceError) else (header, arrays)
            left.discard(rid)
        return out

    def wait_any(self, rids, on_event=None, timeout_s: float | None = None,
                 errors: bool = False) -> tuple[int, dict, list]:
        """(rid, header, arrays) of the first final reply to any request in `rids`, as wait() for one; with errors=True
        an error reply under one of them comes back as (rid, DeviceError, []) instead of raising."""
        timeout = timeout_s or self.timeout_s
        last = time.monotonic()
        last_ping = last
        while True:
            now = time.monotonic()
            if now - last_ping >= HEARTBEAT_S:  # our side of the heartbeat: the agent cancels runs of silent clients
                last_ping = now
                self.send("heartbeat")
            if self.sock.poll(int(HEARTBEAT_S * 1000)):
                header, arrays = unpack(self.sock.recv_multipart(copy=False))
                last = time.monotonic()
                if header.get("id") == NO_ID and header.get("final") and not header.get("ok"):
                    err = header.get("error", {})
                    raise DeviceError(err.get("code", "?"), "the agent could not read the id of a request: "
                                                            f"{err.get('message', '')}")
                rid = header.get("id")
                if rid not in rids:
                    continue  # a reply to one of our heartbeats, or to an abandoned request
                if not header.get("final"):
                    if on_event:
                        on_event(header)
                    continue
                if not header.get("ok"):
                    err = header.get("error", {})
                    e = DeviceError(err.get("code", "?"), err.get("message", "the agent reported an error"))
                    if errors:
                        return rid, e, []
                    raise e
                return rid, header, arrays
            now = time.monotonic()
            if self.process is not None and self.process.poll() is not None:
                raise AgentLostError(f"the local agent {exit_note(self.process.returncode)}; "
                                     f"{stderr_note(self._stderr_tail(wait_s=2.0))}")
            if now - last > timeout:
                note = f"; {stderr_note(self._stderr_tail())}" if self.stderr is not None else ""
                raise AgentLostError(f"the agent at {self.url} sent nothing for {now - last:.1f} s (heartbeat "
                                     f"timeout); it was killed or the connection was cut{note}")

    def _stderr_tail(self, wait_s: float = 0.0, chars: int = 4000) -> str:
        return self.stderr.text(wait_s)[-chars:] if self.stderr is not None else ""

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
    def upload(self, qm, progress: bool = True, chunk_bytes: int = CHUNK_BYTES, window: int = 256,
               window_bytes: int = 64 << 20, has: dict | None = None) -> int:
        """Send every blob of `qm` (a QuantizedModel) that the agent lacks; chunks it already holds from an
        interrupted upload are skipped. Returns the bytes sent. has: the agent's has_blobs reply for qm's blobs,
        if the caller asked already (plan_for).

        Up to `window` chunks and `window_bytes` bytes are in flight (the agent holds them until written and
        hashed); each reply frees its own slot, so a blob being committed does not hold up the chunks behind it."""
        from tqdm.auto import tqdm

        if self._known_model(qm) is not None:
            return 0  # loaded on this connection, so every blob was there (the agent keeps them)
        blobs = qm.manifest["blobs"]
        head = has if has is not None else self.request("has_blobs", ids=list(blobs))[0]
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
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="upload", disable=not progress or not total,
                   leave=False)
        pending: dict[int, int] = {}  # request id -> bytes in flight
        for sha, arr, raw, i, n in todo:
            piece = np.frombuffer(raw[i * chunk_bytes:(i + 1) * chunk_bytes], np.uint8)
            while pending and (len(pending) >= window or sum(pending.values()) + len(piece) > window_bytes):
                sent += pending.pop(self.wait_any(pending)[0])
            rid = self.send("put_blob", [piece], sha=sha, dtype=arr.dtype.name, shape=list(arr.shape), nbytes=len(raw),
                            chunk=i, n_chunks=n, chunk_bytes=chunk_bytes, chunk_crc32=crc32(piece))
            pending[rid] = len(piece)
            bar.update(len(piece))
        while pending:
            sent += pending.pop(self.wait_any(pending)[0])
        bar.close()
        self.uploaded_bytes += sent
        return sent

    # ---- models, plans, runs --------------------------------------------------------------------
    def load_model(self, qm) -> str:
        known = self._known_model(qm)
        if known is not None:
            return known["model_id"]
        return self._remember(qm, self.request("load_model", manifest=_plain(qm.manifest))[0]["model_id"])

    def _remember(self, qm, model_id: str) -> str:
        # not the manifests of dropped models
        self._known = {k: v for k, v in self._known.items() if v["ref"]() is not None}
        self._known[id(qm)] = {"ref": weakref.ref(qm), "manifest": qm.manifest, "model_id": model_id, "plans": {}}
        return model_id

    def put_plan(self, plan: dict) -> str:
        return self.request("put_plan", plan=_plain(plan))[0]["plan_id"]

    def plan_for(self, qm, key, build, progress: bool = True) -> str:
        """The plan id of build() (a plan of qm, named by the hashable `key`), uploading what the agent lacks, loading
        qm and putting the plan only the first time on this connection: a warm prefill then sends only its tokens
        (the upload check, load_model and put_plan round trips are 5-20 ms each, a tenth of a 64-token prefill).
        The first time, has_blobs and load_model go out together and put_plan as soon as the plan is built, so the
        agent answers the first two while this host builds the plan, and the three replies come back in about one
        round trip (over an SSH tunnel to a phone, each saved round trip is a few ms). If a blob was missing, the
        optimistic load_model and put_plan were refused (missing_blob): upload, then both again."""
        if self._known_model(qm) is None:
            blobs = list(qm.manifest["blobs"])
            sent = [self.send("has_blobs", ids=blobs), self.send("load_model", manifest=_plain(qm.manifest))]
            plan = build()
            sent.append(self.send("put_plan", plan=_plain(plan)))
            got = self.wait_all(sent)
            has, loaded, put = (got[r] for r in sent)
            if isinstance(has, DeviceError):
                raise has
            if len(has[0]["have"]) < len(blobs):
                self.upload(qm, progress=progress, has=has[0])
            if isinstance(loaded, DeviceError):  # asked again: missing_blob is now mended, anything else raises
                loaded = self.request("load_model", manifest=_plain(qm.manifest))
            self._remember(qm, loaded[0]["model_id"])
            plan_id = put[0]["plan_id"] if not isinstance(put, DeviceError) else self.put_plan(plan)
            self._known[id(qm)]["plans"][key] = plan_id
        plans = self._known[id(qm)]["plans"]
        if key not in plans:
            plans[key] = self.put_plan(build())
        return plans[key]

    def forget(self) -> None:
        """Drop what this client remembers the agent holds (an agent restarted behind the same address)."""
        self._known.clear()

    def _known_model(self, qm) -> dict | None:
        k = self._known.get(id(qm))
        return k if k is not None and k["ref"]() is qm and k["manifest"] is qm.manifest else None

    def run(self, plan_id: str, inputs: dict, on_progress=None, title: str = "", **fields) -> RunResult:
        """fields: session / advance / phase for a run inside a decode session (docs/protocol.md)."""
        t0 = time.perf_counter()
        names = list(inputs)
        head, arrays = self.request("run", [np.ascontiguousarray(inputs[n]) for n in names], on_event=on_progress,
                                    plan_id=plan_id, inputs=names, **fields)
        wall = time.perf_counter() - t0
        events, off = head["events"], self.clock_offset_us
        for e in events:  # the reply's own dicts, onto the host's clock (a 64-step decode loop's reply has ~2,200)
            e["start_us"] -= off
            e["end_us"] -= off
        meta = {"title": title or "edgeprobe agent run", "agent": self.info.get("agent_version"), "url": self.url,
                "clock_offset_us": self.clock_offset_us, "counters": head.get("counters", {})}
        n_out, raw = len(head["outputs"]), None
        if "numerics" in head:  # asked with numerics=: its full tensors are the frames after the outputs'
            raw = (head["numerics"], arrays[n_out:])
            meta["numerics"] = True
        return RunResult(dict(zip(head["outputs"], arrays[:n_out])), Trace(events, meta), head.get("counters", {}),
                         wall, step_counters=head.get("step_counters", []), numerics_raw=raw)

    def close(self, shutdown: bool | None = None) -> None:
        """Say bye (and stop the agent if this client started it)."""
        stop = self.process is not None if shutdown is None else shutdown
        try:
            if self.sock.closed is False:
                self.request("bye", timeout_s=2.0, shutdown=bool(stop))
        except Exception:
            pass
        self.sock.close(0)
        if self.process is not None:
            try:  # its shutdown writes the layouts still queued (a busy machine: seconds); a hung one is killed
                self.process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
            self.process.stdout.close()
        if self.tunnel is not None:
            self.tunnel.close()
        for d in (self.temp_store, self.agent_path):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_LEAF = frozenset((str, int, float, bool, bytes, type(None)))


def _plain(v):
    """numpy scalars/arrays and tuples -> msgpack-able Python values (map keys as strings). Leaves are passed over
    without a call: a 64-token plan and a manifest are ~18,000 values, 8.3 -> 4.1 ms of a first run."""
    if isinstance(v, dict):
        return {k if type(k) is str else str(k): x if type(x) in _LEAF else _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [x if type(x) in _LEAF else _plain(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v
