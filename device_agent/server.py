"""The agent's ZeroMQ ROUTER loop: one final reply per request, heartbeats, runs on a worker thread.

The loop never dies on a message: anything malformed gets an error reply naming the problem and the
agent keeps serving. Runs execute on a worker thread (lanes inside are threads too), so hello,
heartbeat, stats and cancel are answered while a run is in flight. See docs/protocol.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from . import __version__
from .backends import check_backend, lane_backends
from .executor import EMULATED_LANES, LANES, Context, PlanError, execute, validate, Cancelled
from .ops import OpError
from .session import KVSession
from .protocol import (HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, PROTOCOL_VERSION, ProtocolError, check_request,
                       error_reply, pack, unpack)
from .store import FlashStore, StoreError, check_sha, now_us

LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


def is_loopback(url: str) -> bool:
    if url.startswith(("ipc://", "inproc://")):
        return True
    host = url.split("://", 1)[-1].rsplit(":", 1)[0]
    return host in LOOPBACK


def opencl_devices() -> list[dict]:
    try:
        import pyopencl as cl
    except ImportError:
        return []
    try:
        return [{"platform": p.name, "device": d.name, "fp16": "cl_khr_fp16" in d.extensions,
                 "compute_units": d.max_compute_units} for p in cl.get_platforms() for d in p.get_devices()]
    except Exception:  # no ICD installed: no GPU lane
        return []


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class _Outbox(queue.Queue):
    """Messages from worker threads to the loop (only the loop touches the socket); each put also
    writes a byte to a pipe the loop polls, so replies go out at once, not at the next poll timeout."""

    def __init__(self):
        super().__init__()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the loop is awake anyway

    def clear_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass


@dataclass
class _Run:
    rid: int
    ident: bytes
    cancel: threading.Event = field(default_factory=threading.Event)
    last_seen: float = field(default_factory=time.monotonic)
    session: object = None   # the KVSession the run reads and extends
    advance: int = 0         # positions it adds to the session on success


class Agent:
    def __init__(self, bind: str, store_dir, memory_budget: int | None = None, curve_secret: bytes | None = None,
                 curve_public: bytes | None = None, lanes=None, parent_pid: int | None = None,
                 npu_backend: str = "numba"):
        if not is_loopback(bind) and not curve_secret:
            raise ValueError(f"refusing to bind {bind}: outside loopback the agent needs CURVE keys "
                             "(--curve-keys DIR made with zmq.auth.create_certificates); or bind tcp://127.0.0.1:PORT")
        self.npu_backend = check_backend("npu", npu_backend)  # before the socket: a missing toolchain stops here
        self.flash_events: list = []
        self.store = FlashStore(store_dir, memory_budget, on_read=self._on_read)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if curve_secret:
            self.sock.curve_secretkey, self.sock.curve_publickey, self.sock.curve_server = curve_secret, curve_public, True
        self.sock.bind(bind)
        self.url = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.outbox = _Outbox()
        self.models: dict = {}
        self.plans: dict = {}
        self.runs: dict[int, _Run] = {}
        # compiled linear runners (dequantized weights, OpenCL buffers) live across runs; counters too,
        # and each run reports its own difference
        self.runners: dict = {}
        self.counters: dict = {}
        self.sessions: dict[str, KVSession] = {}  # decode sessions: KV caches kept across runs
        self.served = 0
        self.errors = 0
        if lanes is not None and (not lanes or set(lanes) - set(LANES)):
            raise ValueError(f"lanes must be some of {', '.join(LANES)}, got {', '.join(lanes) or 'none'}")
        if lanes is not None and "gpu" in lanes and not opencl_devices():
            raise ValueError("the gpu lane needs an OpenCL device and none was found (Debian: pocl-opencl-icd)")
        self.lanes = [l for l in LANES if (l in lanes if lanes is not None else (l != "gpu" or opencl_devices()))]
        self._stop = False
        self.parent_pid = parent_pid
        self._parent_is_ppid = parent_pid is not None and os.getppid() == parent_pid

    def _on_read(self, ev):
        self.flash_events.append(ev)

    # ---- the loop -------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.outbox.wake_r, zmq.POLLIN)  # replies from worker threads wake the loop at once
        last_hb = time.monotonic()
        while not self._stop:
            ready = dict(poller.poll(int(HEARTBEAT_S * 1000 / 5)))
            if ready.get(self.sock):
                self._handle(self.sock.recv_multipart(copy=False))
            if ready.get(self.outbox.wake_r):
                self.outbox.clear_wake()
            self._flush_outbox()
            now = time.monotonic()
            if now - last_hb >= HEARTBEAT_S:
                last_hb = now
                if self._host_gone():
                    print(f"edgeprobe-agent: the host process {self.parent_pid} is gone; stopping", file=sys.stderr, flush=True)
                    for r in list(self.runs.values()):
                        r.cancel.set()
                    break
                for r in list(self.runs.values()):
                    self._send(r.ident, {"id": r.rid, "final": False, "event": "heartbeat", "clock_us": now_us()})
                    if now - r.last_seen > HEARTBEAT_TIMEOUT_S:
                        r.cancel.set()  # the client went silent: stop its work
        self._flush_outbox()
        self.store.close()
        self.sock.close(0)

    def _host_gone(self) -> bool:
        """Has the process named by --parent-pid exited? A dead direct parent re-parents us (it may linger as a
        zombie, which signal 0 would still find); any other pid is probed with signal 0."""
        if self.parent_pid is None:
            return False
        if self._parent_is_ppid:
            return os.getppid() != self.parent_pid
        try:
            os.kill(self.parent_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def _send(self, ident: bytes, header: dict, arrays=()) -> None:
        self.sock.send_multipart([ident] + pack(header, arrays), copy=False)

    def _flush_outbox(self) -> None:
        while True:
            try:
                ident, header, arrays = self.outbox.get_nowait()
            except queue.Empty:
                return
            self._send(ident, header, arrays)

    def _handle(self, frames) -> None:
        ident = bytes(frames[0])
        rid = -1
        try:
            header, arrays = unpack([f.buffer for f in frames[1:]])
            rid = header.get("id", -1)
            rid, op = check_request(header)
            for r in self.runs.values():
                if r.ident == ident:
                    r.last_seen = time.monotonic()
            reply = getattr(self, f"do_{op}")(ident, rid, header, arrays)
            self.served += 1
            if reply is not None:
                hdr, out = reply if isinstance(reply, tuple) else (reply, ())
                self._send(ident, {"id": rid, "final": True, "ok": True, **hdr}, out)
        except (ProtocolError, StoreError, PlanError, OpError) as e:
            self.errors += 1
            self._send(ident, error_reply(rid, e.code, str(e)))
        except Exception as e:  # the agent survives anything a message can provoke
            self.errors += 1
            self._send(ident, error_reply(rid, "internal", f"{type(e).__name__}: {e}"))

    # ---- requests ---------------------------------------------------------------------------------
    def do_hello(self, ident, rid, h, arrays):
        import numba

        cl = opencl_devices()
        return {"agent_version": __version__, "protocol": PROTOCOL_VERSION, "lanes": self.lanes,
                "emulated_lanes": list(EMULATED_LANES), "backends": lane_backends({"npu": self.npu_backend}, self.lanes, cl),
                "cpu": platform.processor() or platform.machine(),
                "machine": platform.machine(), "system": platform.system(), "cores": os.cpu_count(),
                "memory_bytes": _memory_bytes(), "opencl": cl, "clock_us": now_us(),
                "numpy": np.__version__, "numba": numba.__version__, "store": self.store.stats()}

    def do_heartbeat(self, ident, rid, h, arrays):
        return {"clock_us": now_us()}

    def do_stats(self, ident, rid, h, arrays):
        return {"store": self.store.stats(), "served": self.served, "errors": self.errors, "models": len(self.models),
                "plans": len(self.plans), "runs_in_flight": len(self.runs)}

    def do_bye(self, ident, rid, h, arrays):
        if h.get("shutdown"):
            self._stop = True
        return {}

    def do_has_blobs(self, ident, rid, h, arrays):
        ids = h.get("ids")
        if not isinstance(ids, list):
            raise ProtocolError("bad_request", "has_blobs needs 'ids', a list of sha256 strings")
        have, partial = [], {}
        for s in ids:
            check_sha(s)
            if self.store.has(s):
                have.append(s)
            else:
                chunks = self.store.partial_chunks(s)
                if chunks:
                    partial[s] = chunks
        return {"have": have, "partial": partial}

    def do_put_blob(self, ident, rid, h, arrays):
        need = {"sha": str, "dtype": str, "shape": list, "nbytes": int, "chunk": int, "n_chunks": int,
                "chunk_bytes": int, "chunk_crc32": int}
        for k, t in need.items():
            if not isinstance(h.get(k), t):
                raise ProtocolError("bad_request", f"put_blob needs {k!r} ({t.__name__})")
        if len(arrays) != 1 or arrays[0].dtype != np.uint8:
            raise ProtocolError("bad_request", "put_blob carries exactly one uint8 frame: the chunk's bytes")
        if h["chunk_bytes"] <= 0:
            raise ProtocolError("bad_request", "chunk_bytes must be positive")
        try:
            np.dtype(h["dtype"])
        except TypeError:
            raise ProtocolError("bad_request", f"unknown dtype {h['dtype'][:20]!r}") from None
        chunk = h["chunk"]

        def done(result):  # called here, or from the store's worker once the last chunk's blob is finished
            if isinstance(result, StoreError):
                self.outbox.put((ident, error_reply(rid, result.code, str(result)), ()))
            else:
                self.outbox.put((ident, {"id": rid, "final": True, "ok": True, "chunk": chunk, "complete": bool(result)}, ()))
        self.store.put_chunk(h["sha"], h["dtype"], h["shape"], h["nbytes"], chunk, h["n_chunks"], h["chunk_bytes"],
                             h["chunk_crc32"], arrays[0], on_done=done)
        return None

    def do_load_model(self, ident, rid, h, arrays):
        m = h.get("manifest")
        if not isinstance(m, dict) or not isinstance(m.get("blobs"), dict):
            raise ProtocolError("bad_request", "load_model needs 'manifest', a quantized model manifest with 'blobs'")
        missing = [s for s in m["blobs"] if not self.store.has(check_sha(s))]
        if missing:
            raise StoreError("missing_blob", f"{len(missing)} blobs of this model are not uploaded (e.g. {missing[0][:12]}); "
                                             "upload them first")
        model_id = hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:16]
        self.models[model_id] = m
        return {"model_id": model_id, "blobs": len(m["blobs"]),
                "bytes": int(sum(b.get("nbytes", 0) for b in m["blobs"].values()))}

    def do_open_session(self, ident, rid, h, arrays):
        """A KV cache for `batch` sequences of up to `capacity` positions of the loaded `model_id`."""
        m = self.models.get(h.get("model_id"))
        if m is None:
            raise ProtocolError("unknown_model", f"no model {str(h.get('model_id'))[:20]!r}; load_model first")
        sid, batch, cap = h.get("session"), h.get("batch"), h.get("capacity")
        if not isinstance(sid, str) or not sid or len(sid) > 64:
            raise ProtocolError("bad_request", "open_session needs 'session', a name of 1-64 characters")
        if not isinstance(batch, int) or batch < 1 or not isinstance(cap, int) or cap < 1:
            raise ProtocolError("bad_request", "open_session needs 'batch' and 'capacity', positive integers")
        c = m["config"]
        if cap > c["context_length"]:
            raise ProtocolError("bad_request", f"capacity {cap} exceeds the model's context length {c['context_length']}")
        need = KVSession.nbytes_for(c["n_layers"], c["n_kv_heads"], c["head_dim"], batch, cap)
        budget = self.store.memory_budget
        if budget is not None:
            streamed = set(m.get("streamed_blobs", []))  # read from flash on demand, never all resident
            resident = sum(int(b.get("nbytes", 0)) for s_, b in m["blobs"].items() if s_ not in streamed)
            others = sum(x.nbytes for k, x in self.sessions.items() if k != sid)
            if resident > budget:
                raise ProtocolError("memory_budget", f"the model's resident weights need {resident / 1e6:.1f} MB but the "
                                                     f"memory budget is {budget / 1e6:.1f} MB; raise --memory-budget")
            if resident + others + need > budget:
                raise ProtocolError("memory_budget", f"a KV cache for batch {batch} x {cap} positions needs "
                                                     f"{need / 1e6:.1f} MB; the budget of {budget / 1e6:.1f} MB leaves "
                                                     f"{max(budget - resident - others, 0) / 1e6:.1f} MB beside the resident "
                                                     "weights and other sessions; lower the batch or raise --memory-budget")
        self.sessions[sid] = KVSession(c["n_layers"], c["n_kv_heads"], c["head_dim"], batch, cap)
        return {"session": sid, "kv_bytes": need}

    def do_session_reorder(self, ident, rid, h, arrays):
        sess = self._session(h.get("session"))
        sess.reorder(h.get("indices") if isinstance(h.get("indices"), list) else [])
        return {"session": h["session"], "batch": sess.batch, "length": sess.length}

    def do_close_session(self, ident, rid, h, arrays):
        sess = self._session(h.get("session"))
        buf = sess.extras.get("experts", {}).get("buffer")
        if buf is not None:
            buf.close()  # its I/O thread
        del self.sessions[h["session"]]
        return {}

    def _session(self, sid) -> KVSession:
        sess = self.sessions.get(sid) if isinstance(sid, str) else None
        if sess is None:
            raise ProtocolError("unknown_session", f"no session {str(sid)[:20]!r}; open_session first")
        if any(r.session is sess for r in self.runs.values()):
            raise ProtocolError("busy", "the session has a run in flight")
        return sess

    def do_put_plan(self, ident, rid, h, arrays):
        plan = validate(h.get("plan"), self.store.has, self.lanes)
        plan_id = hashlib.sha256(json.dumps(h.get("plan"), sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.plans[plan_id] = plan
        return {"plan_id": plan_id, "ops": len(plan.order), "lanes": {k: len(v) for k, v in plan.lane_order.items()}}

    def do_cancel(self, ident, rid, h, arrays):
        target = h.get("target")
        r = self.runs.get((ident, target))
        if r is None:
            raise ProtocolError("unknown_target", f"no run with id {target!r} in flight for this client")
        r.cancel.set()
        return {"cancelled": target}

    def do_run(self, ident, rid, h, arrays):
        plan = self.plans.get(h.get("plan_id"))
        if plan is None:
            raise ProtocolError("unknown_plan", f"no plan {str(h.get('plan_id'))[:20]!r}; send it with put_plan first")
        names = h.get("inputs", [])
        if not isinstance(names, list) or len(names) != len(arrays) or not all(isinstance(n, str) for n in names):
            raise ProtocolError("bad_request", "run needs 'inputs': one name per attached frame")
        if (ident, rid) in self.runs:
            raise ProtocolError("bad_id", f"request id {rid} is already running")
        sess, advance = None, 0
        if h.get("session") is not None:
            sess = self._session(h.get("session"))
            advance = h.get("advance")
            if not isinstance(advance, int) or advance < 1:
                raise ProtocolError("bad_request", "a run in a session needs 'advance', the positions it adds (>= 1)")
            if h.get("phase") == "decode" and sess.length == 0:
                raise ProtocolError("no_prefill", "decode step on an empty session: prefill the prompt first")
            if sess.length + advance > sess.capacity:
                raise ProtocolError("context_full", f"{sess.length + advance} positions exceed the session's capacity "
                                                    f"{sess.capacity}")
        run = self.runs[(ident, rid)] = _Run(rid, ident)
        run.session, run.advance = sess, advance
        inputs = {n: np.array(a) for n, a in zip(names, arrays)}  # own the bytes: frames are recycled
        threading.Thread(target=self._run_worker, args=(run, plan, inputs), daemon=True, name=f"run-{rid}").start()
        return None  # the worker sends the final reply

    def _run_worker(self, run: _Run, plan, inputs) -> None:
        total = len(plan.order)
        state = {"done": 0, "last": 0.0}
        self.flash_events.clear()

        def on_op(ev):
            state["done"] += 1
            t = time.monotonic()
            if t - state["last"] > 0.2 or state["done"] == total:
                state["last"] = t
                self.outbox.put((run.ident, {"id": run.rid, "final": False, "event": "progress",
                                             "done": state["done"], "total": total}, ()))
        try:
            ctx = Context(get=self.store.get, counters=self.counters, runners=self.runners, session=run.session,
                          read_rows=self.store.read_rows, read_blob=self.store.read_cold,
                          backends={"npu": self.npu_backend})
            before = dict(self.counters)
            t0 = now_us()
            outs, events = execute(plan, inputs, ctx, run.cancel, on_op)
            t1 = now_us()
            if run.session is not None:
                run.session.length += run.advance  # only a whole, successful run moves the cache on
            hdr = {"id": run.rid, "final": True, "ok": True, "outputs": list(outs), "events": events + list(self.flash_events),
                   "counters": {k: int(v - before.get(k, 0)) for k, v in self.counters.items()}, "start_us": t0, "end_us": t1}
            self.outbox.put((run.ident, hdr, [np.ascontiguousarray(a) for a in outs.values()]))
        except Cancelled:
            self.outbox.put((run.ident, error_reply(run.rid, "cancelled", "the run was cancelled"), ()))
        except (OpError, PlanError, StoreError) as e:
            self.outbox.put((run.ident, error_reply(run.rid, e.code, str(e)), ()))
        except Exception as e:
            self.outbox.put((run.ident, error_reply(run.rid, "internal", f"{type(e).__name__}: {e}"), ()))
        finally:
            self.runs.pop((run.ident, run.rid), None)
