"""The agent's ZeroMQ ROUTER loop: exactly one final reply per request, heartbeats, runs on worker threads.

The loop never dies on a message: anything malformed gets an error reply naming the problem, under the
request's own id whenever the header parses to a map with an integer id, and the agent keeps serving. Runs
execute on worker threads (lanes inside are threads too), so hello, heartbeat, stats and cancel are answered
while runs are in flight. See docs/protocol.md.

Who owns what (no state is shared without an owner):
- The loop thread owns the socket and every registry: `runs`, `sessions`, `models`, `plans`, and the
  served/errors counts. No other thread reads or writes them, so the loop never iterates a dict another
  thread changes, and check-then-act steps (is the session busy? then register the run) need no lock.
- A run's worker thread owns its Context (its own counters and flash-read log) and, while the run is in
  flight, its session (the loop refuses any other request on a busy session). It hands the loop exactly one
  item at its end, through the outbox: ("run_done", run, header, arrays). The store's threads hand
  put_blob's deferred reply the same way ("final", ...), and so does the thread that validates a plan
  ("done", ...: a plan of many thousand ops takes seconds on a busy phone, and the loop must keep answering
  heartbeats meanwhile; the loop files the plan and replies).
- On a run's done item the loop removes the run from `runs` and moves its session on (only after a whole,
  successful run) and only then sends the final reply: a client that sends its next decode step the moment
  it reads a reply finds the session idle. A lock around the registries would serve as well, but the loop
  is where replies are sent anyway; with one owner the order "settle, then reply" is simply program order.
"""
from __future__ import annotations

import gc
import hashlib
import os
import platform
import queue
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial

import msgpack
import numpy as np
import zmq

from edgeprobe_kernels.numerics import CAPTURE_VERSION, Capture, CaptureError

from . import __version__
from .backends import check_backend, lane_backends, lane_kernels, opencl_devices, opencl_unavailable
from .executor import EMULATED_LANES, LANES, Cancelled, Context, capture_names, execute, validate
from .ops import OpError, RunnerCache
from .protocol import (
    ALLOWED_DTYPES,
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    MAX_STEPS,
    NO_ID,
    PROTOCOL_VERSION,
    AgentError,
    ProtocolError,
    check_request,
    error_reply,
    is_shape,
    pack,
    request_id,
    unpack_frames,
    unpack_header,
)
from .session import KVSession
from .store import FlashStore, StoreError, check_sha, now_us
from .threads import CORES_IN_USE

LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")
RECV_BATCH = 256           # messages read per loop turn before the outbox is served again
STOP_GRACE_S = 5.0         # at shutdown, how long runs in flight get to end (cancelled) and send their reply


def is_loopback(url: str) -> bool:
    if url.startswith(("ipc://", "inproc://")):
        return True
    host = url.split("://", 1)[-1].rsplit(":", 1)[0]
    return host in LOOPBACK


def numba_version() -> str | None:
    """numba's version, or None where it is missing (a phone under Termux may lack it; kernels fall back)."""
    try:
        import numba
    except ImportError:  # absent: the kernels' numpy versions run
        return None
    return numba.__version__


def numba_threading() -> str | None:
    """The threading layer numba's parallel kernels use ("tbb" where the tbb wheel is installed: edgeprobe_kernels
    picks it; "omp", "workqueue"), the one requested before the first parallel call, or None without numba."""
    import edgeprobe_kernels  # noqa: F401  (chooses the layer on import)

    try:
        import numba
    except ImportError:
        return None
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet: the layer it will load
        return numba.config.THREADING_LAYER


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class _Outbox(queue.Queue):
    """Items from worker threads to the loop (only the loop touches the socket); each put also writes a
    byte to a pipe the loop polls, so replies go out at once, not at the next poll timeout."""

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


class _FlashLog:
    """One run's flash-read events: appended by its lane threads and its session's I/O thread, read by its
    worker once they are all done."""

    def __init__(self):
        self._events: list = []
        self._skip = 0
        self._lock = threading.Lock()

    def add(self, ev: dict) -> None:
        with self._lock:
            self._events.append(ev)

    def events(self) -> list:
        with self._lock:
            return self._events[self._skip:]

    def skip(self, n: int) -> None:
        """events() leaves out the first n from now on (a decode loop reported them with its steps)."""
        with self._lock:
            self._skip = n


class _Workers:
    """Threads that outlive their task and take the next one: a decode step costs no thread start (which waits on
    the GIL) and its numba kernels reuse the OpenMP team their thread built (a new thread builds a new one).
    Never blocks: with no idle thread a new one starts, so a long run cannot hold up a short one. A task goes to
    the thread idle the shortest (each idle thread waits on its own inbox, `_idle` a stack of them under `_lock`),
    so back-to-back runs use one thread and one OpenMP team: libgomp spins only while its threads are no more
    than the cores, and every further team (kept by a live thread) makes each parallel region sleep and wake
    (a decode step +3 ms, 120 regions). At most `keep` idle threads stay, extras end."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._idle: list = []  # inboxes (queue.SimpleQueue) of idle threads, the most recently idle last
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> None:
        with self._lock:
            if self._idle:
                self._idle.pop().put((fn, args))  # out of the stack: that thread's next get() is this task alone
                return
        # a new thread gets its first task directly: if it cannot start, nothing was queued and the caller reports it
        threading.Thread(target=self._loop, args=((fn, args),), daemon=True, name="agent-worker").start()

    def _loop(self, task) -> None:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        while True:
            fn, args = task
            try:
                fn(*args)
            except BaseException:  # tasks report their own failures (through the outbox); a thread must not die
                pass
            task = fn = args = None  # an idle thread holds no run's inputs
            with self._lock:
                if len(self._idle) >= self.keep:
                    return
                self._idle.append(inbox)
            task = inbox.get()


@dataclass
class _Run:
    rid: int
    ident: bytes
    cancel: threading.Event = field(default_factory=threading.Event)
    last_seen: float = field(default_factory=time.monotonic)  # written and read by the loop only
    session: object = None   # the KVSession the run reads and extends
    advance: int = 0         # positions it adds to the session on success (every step's together)
    steps: int = 1           # passes of the plan; after the first, each is fed the argmax of the one before
    keep: str = "last"       # which steps' outputs the reply carries: "last" or "all" (stacked on a new axis 0)
    loop: bool = False       # a greedy decode loop (the request named steps): its reply adds fed and step_counters


def _per_run(get):
    """get(sha) remembered for one run, for a store without a memory budget (whose resident blobs never leave):
    a decode loop's steps ask for their ~60 norm weights each, through the store's lock and LRU order (~1.5 us
    each with the caches swept by the weights). Lanes share it: dict reads and setdefault are atomic, and two
    lanes asking at once get the store's one array."""
    seen: dict = {}

    def cached(sha):
        a = seen.get(sha)
        return a if a is not None else seen.setdefault(sha, get(sha))
    return cached


def _content_id(value) -> str:
    """16 hex digits of the sha256 of a model's manifest or a plan as msgpack (a plan of 64 tokens: 215 kB, 0.8 ms;
    sorted JSON took 4.2). The same message gives the same id; one sent with its keys in another order, another."""
    return hashlib.sha256(msgpack.packb(value, use_bin_type=True)).hexdigest()[:16]


class Agent:
    def __init__(self, bind: str, store_dir, memory_budget: int | None = None, curve_secret: bytes | None = None,
                 curve_public: bytes | None = None, lanes=None, parent_pid: int | None = None,
                 npu_backend: str = "numba"):
        if not is_loopback(bind) and not curve_secret:
            raise ValueError(f"refusing to bind {bind}: outside loopback the agent needs CURVE keys "
                             "(--curve-keys DIR made with zmq.auth.create_certificates); or bind tcp://127.0.0.1:PORT")
        self.npu_backend = check_backend("npu", npu_backend)  # before the socket: a missing toolchain stops here
        if lanes is not None and (not lanes or set(lanes) - set(LANES)):
            raise ValueError(f"lanes must be some of {', '.join(LANES)}, got {', '.join(lanes) or 'none'}")
        if lanes is not None and "gpu" in lanes and not opencl_devices():
            raise ValueError(f"the gpu lane needs an OpenCL device: {opencl_unavailable()}")
        self.lanes = [l for l in LANES if (l in lanes if lanes is not None else (l != "gpu" or opencl_devices()))]
        # lanes this agent does without, and why (hello says so: a phone whose OpenCL driver Termux cannot reach)
        self.lanes_missing = {l: ("not asked for (--lanes)" if lanes is not None else opencl_unavailable())
                              for l in LANES if l not in self.lanes}
        # set by the launcher that runs this Python under an ISA emulator (the arm64 wrapper: "qemu-aarch64"): the cpu
        # lane's results are real arm64 results but its times are emulation times, and every event says so
        self.emulator = os.environ.get("EDGEPROBE_EMULATOR") or None
        self.emulated = {**EMULATED_LANES, **({"cpu": "isa"} if self.emulator else {})}
        # what computes on each lane, fixed for the agent's life: every trace event says it ("backend")
        self.kernels = {l: lane_kernels(l, self.npu_backend if l == "npu" else "opencl" if l == "gpu" else None)
                        for l in self.lanes}
        self.store = FlashStore(store_dir, memory_budget)
        self.malloc: dict = {}  # the malloc settings the launcher made (__main__._malloc_settings): hello says them
        self.files: dict = {}   # the open-file limit and file table the launcher made (__main__._file_table): hello too
        self.ctx = zmq.Context()  # the agent's own: term() at exit waits for its last replies to leave
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if curve_secret:
            self.sock.curve_secretkey, self.sock.curve_publickey = curve_secret, curve_public
            self.sock.curve_server = True
        self.sock.bind(bind)
        self.url = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.outbox = _Outbox()
        # the loop's registries (see the module docstring: only the loop thread touches them)
        self.models: dict = {}
        self.plans: dict = {}
        self.runs: dict[tuple, _Run] = {}
        self.sessions: dict[str, KVSession] = {}  # decode sessions: KV caches kept across runs
        self.served = 0   # final replies sent with ok true
        self.errors = 0   # final replies sent with ok false
        # compiled linear runners (dequantized weights, OpenCL buffers) live across runs, shared under a lock
        self.runners = RunnerCache()
        self.workers = _Workers()  # run and plan-validation threads, kept for the next request
        self._stop = False
        self.parent_pid = parent_pid
        self._parent_is_ppid = parent_pid is not None and os.getppid() == parent_pid

    # ---- the loop -------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.outbox.wake_r, zmq.POLLIN)  # replies from worker threads wake the loop at once
        last_hb = time.monotonic()
        while not self._stop:
            poller.poll(int(HEARTBEAT_S * 1000 / 5))
            self._serve_outbox()  # finished runs leave the registry before the next requests are read
            for _ in range(RECV_BATCH):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
                if self._stop:
                    break
            self._serve_outbox()
            now = time.monotonic()
            if now - last_hb >= HEARTBEAT_S:
                last_hb = now
                if self._host_gone():
                    print(f"edgeprobe-agent: the host process {self.parent_pid} is gone; stopping", file=sys.stderr,
                          flush=True)
                    break
                for r in self.runs.values():
                    self._send(r.ident, pack({"id": r.rid, "final": False, "event": "heartbeat", "clock_us": now_us()}))
                    if now - r.last_seen > HEARTBEAT_TIMEOUT_S:
                        r.cancel.set()  # the client went silent: stop its work
        self._shutdown()

    def _shutdown(self) -> None:
        """Cancel the runs in flight and let each send its final reply (cancelled), finish queued uploads
        (their replies too), then close the socket, giving the last replies a moment to leave."""
        for r in self.runs.values():
            r.cancel.set()
        deadline = time.monotonic() + STOP_GRACE_S
        while self.runs and time.monotonic() < deadline:
            zmq.select([self.outbox.wake_r], [], [], 0.05)
            self._serve_outbox()
        self.store.close()
        self._serve_outbox()
        for sess in self.sessions.values():
            sess.close()
        self.sock.close(linger=1000)
        self.ctx.term()
        self.store.unlock()

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

    def _send(self, ident: bytes, frames: list) -> None:
        try:
            self.sock.send_multipart([ident] + frames, copy=False)
        except zmq.ZMQError as e:  # the loop must survive a send it cannot make
            print(f"edgeprobe-agent: a reply could not be sent ({e})", file=sys.stderr, flush=True)

    def _final(self, ident: bytes, header: dict, arrays=()) -> None:
        """Send a request's one final reply and count it. A reply that cannot be packed becomes an internal
        error under the same id, so the request is still answered."""
        try:
            frames = pack(header, arrays)
        except Exception as e:
            header = error_reply(header.get("id"), "internal",
                                 f"the reply could not be packed ({type(e).__name__}: {e})")
            frames = pack(header)
        if header.get("ok"):
            self.served += 1
        else:
            self.errors += 1
        self._send(ident, frames)

    def _serve_outbox(self) -> None:
        self.outbox.clear_wake()  # before draining: an item put after the drain wakes the next poll
        while True:
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "send":       # a non-final message (progress)
                self._send(item[1], item[2])
            elif kind == "final":    # a deferred final reply (put_blob's last chunk)
                self._final(item[1], item[2], item[3])
            elif kind == "done":     # work done off the loop: the loop commits it to its registries, then replies
                ident, rid, result, commit = item[1:]
                try:
                    if isinstance(result, BaseException):
                        raise result
                    header = {"id": rid, "final": True, "ok": True, **commit(result)}
                except AgentError as e:
                    header = error_reply(rid, e.code, str(e))
                except BaseException as e:
                    header = error_reply(rid, "internal", f"{type(e).__name__}: {e}")
                self._final(ident, header)
            else:                    # "run_done": settle the registry and the session, then reply
                run, header, arrays = item[1:]
                self.runs.pop((run.ident, run.rid), None)
                if header.get("ok") and run.session is not None:
                    run.session.length += run.advance  # only a whole, successful run moves the cache on
                self._final(run.ident, header, arrays)

    def _handle(self, frames) -> None:
        ident = bytes(frames[0])
        rid = NO_ID
        try:
            if len(frames) < 2:
                raise ProtocolError("empty", "empty message")
            header = unpack_header(frames[1])
            rid = request_id(header)  # from here on every reply, error or not, carries the request's id
            arrays = unpack_frames(header, [f.buffer for f in frames[2:]])
            _, op = check_request(header)
            now = time.monotonic()
            for r in self.runs.values():
                if r.ident == ident:
                    r.last_seen = now
            reply = getattr(self, f"do_{op}")(ident, rid, header, arrays)
            if reply is not None:
                hdr, out = reply if isinstance(reply, tuple) else (reply, ())
                self._final(ident, {"id": rid, "final": True, "ok": True, **hdr}, out)
        except AgentError as e:
            self._final(ident, error_reply(rid, e.code, str(e)))
        except Exception as e:  # the agent survives anything a message can provoke
            self._final(ident, error_reply(rid, "internal", f"{type(e).__name__}: {e}"))

    # ---- requests ---------------------------------------------------------------------------------
    def do_hello(self, ident, rid, h, arrays):
        cl = opencl_devices()
        return {"agent_version": __version__, "protocol": PROTOCOL_VERSION, "lanes": self.lanes,
                "lanes_missing": self.lanes_missing, "emulated_lanes": list(self.emulated), "emulator": self.emulator,
                "backends": lane_backends({"npu": self.npu_backend}, self.lanes, cl),
                "cpu": platform.processor() or platform.machine(),
                "machine": platform.machine(), "system": platform.system(), "cores": os.cpu_count(),
                "memory_bytes": _memory_bytes(), "opencl": cl, "clock_us": now_us(),
                "numpy": np.__version__, "numba": numba_version(), "numba_threading": numba_threading(),
                "store": self.store.stats(), "malloc": self.malloc, "files": self.files, "numerics": CAPTURE_VERSION}

    def do_heartbeat(self, ident, rid, h, arrays):
        return {"clock_us": now_us()}

    def do_stats(self, ident, rid, h, arrays):
        """served / errors count the final replies sent before this one."""
        return {"store": self.store.stats(), "served": self.served, "errors": self.errors, "models": len(self.models),
                "plans": len(self.plans), "runs_in_flight": len(self.runs), "sessions": len(self.sessions),
                # what a full collection walks (objects since the start's gc.freeze) and how often it ran
                "gc": {"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
                       "full_collections": gc.get_stats()[2]["collections"]}}

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
            if not isinstance(h.get(k), t) or isinstance(h.get(k), bool):
                raise ProtocolError("bad_request", f"put_blob needs {k!r} ({t.__name__})")
        if len(arrays) != 1 or arrays[0].dtype != np.uint8:
            raise ProtocolError("bad_request", "put_blob carries exactly one uint8 frame: the chunk's bytes")
        if h["chunk_bytes"] <= 0:
            raise ProtocolError("bad_request", "chunk_bytes must be positive")
        if h["dtype"] not in ALLOWED_DTYPES:
            raise ProtocolError("bad_request", f"blob dtype {h['dtype'][:20]!r} is not one of {sorted(ALLOWED_DTYPES)}")
        if not is_shape(h["shape"]):
            raise ProtocolError("bad_request", "put_blob's 'shape' must be a list of non-negative ints")
        chunk = h["chunk"]

        def done(result):  # from the store's threads: once the chunk is written and hashed, or the blob committed
            if isinstance(result, StoreError):
                self.outbox.put(("final", ident, error_reply(rid, result.code, str(result)), ()))
            else:
                self.outbox.put(("final", ident, {"id": rid, "final": True, "ok": True, "chunk": chunk,
                                                  "complete": bool(result)}, ()))
        self.store.put_chunk(h["sha"], h["dtype"], h["shape"], h["nbytes"], chunk, h["n_chunks"], h["chunk_bytes"],
                             h["chunk_crc32"], arrays[0], on_done=done)
        return None  # the reply goes through the outbox, from whichever thread finished the chunk

    def do_load_model(self, ident, rid, h, arrays):
        m = h.get("manifest")
        if not isinstance(m, dict) or not isinstance(m.get("blobs"), dict):
            raise ProtocolError("bad_request", "load_model needs 'manifest', a quantized model manifest with 'blobs'")
        missing = [s for s in m["blobs"] if not self.store.has(check_sha(s))]
        if missing:
            raise StoreError("missing_blob", f"{len(missing)} blobs of this model are not uploaded "
                                             f"(e.g. {missing[0][:12]}); upload them first")
        model_id = _content_id(m)
        self.models.setdefault(model_id, m)  # as put_plan: the first copy stays
        return {"model_id": model_id, "blobs": len(m["blobs"]),
                "bytes": int(sum(b.get("nbytes", 0) for b in m["blobs"].values() if isinstance(b, dict)))}

    def do_open_session(self, ident, rid, h, arrays):
        """A KV cache for `batch` sequences of up to `capacity` positions of the loaded `model_id`."""
        m = self.models.get(h.get("model_id")) if isinstance(h.get("model_id"), str) else None
        if m is None:
            raise ProtocolError("unknown_model", f"no model {str(h.get('model_id'))[:20]!r}; load_model first")
        sid, batch, cap = h.get("session"), h.get("batch"), h.get("capacity")
        if not isinstance(sid, str) or not sid or len(sid) > 64:
            raise ProtocolError("bad_request", "open_session needs 'session', a name of 1-64 characters")
        if not isinstance(batch, int) or batch < 1 or not isinstance(cap, int) or cap < 1:
            raise ProtocolError("bad_request", "open_session needs 'batch' and 'capacity', positive integers")
        c = m.get("config")
        keys = ("n_layers", "n_kv_heads", "head_dim", "context_length")
        if not isinstance(c, dict) or not all(isinstance(c.get(k), int) and c[k] > 0 for k in keys):
            raise ProtocolError("bad_request", f"the model's manifest has no config with positive {', '.join(keys)}")
        if cap > c["context_length"]:
            raise ProtocolError("bad_request",
                                f"capacity {cap} exceeds the model's context length {c['context_length']}")
        old = self.sessions.get(sid)
        if old is not None and self._busy(old):
            raise ProtocolError("busy", f"session {sid!r} has a run in flight; it cannot be replaced now")
        need = KVSession.nbytes_for(c["n_layers"], c["n_kv_heads"], c["head_dim"], batch, cap)
        budget = self.store.memory_budget
        if budget is not None:
            streamed = set(m.get("streamed_blobs", []))  # read from flash on demand, never all resident
            resident = sum(int(b.get("nbytes", 0)) for s_, b in m["blobs"].items() if s_ not in streamed)
            others = sum(x.nbytes for k, x in self.sessions.items() if k != sid)
            if resident > budget:
                raise ProtocolError("memory_budget", f"the model's resident weights need {resident / 1e6:.1f} MB but "
                                                     f"the memory budget is {budget / 1e6:.1f} MB; "
                                                     "raise --memory-budget")
            if resident + others + need > budget:
                raise ProtocolError("memory_budget", f"a KV cache for batch {batch} x {cap} positions needs "
                                                     f"{need / 1e6:.1f} MB; the budget of {budget / 1e6:.1f} MB leaves "
                                                     f"{max(budget - resident - others, 0) / 1e6:.1f} MB beside the "
                                                     "resident weights and other sessions; lower the batch or raise "
                                                     "--memory-budget")
        if old is not None:
            old.close()  # its I/O thread
        self.sessions[sid] = KVSession(c["n_layers"], c["n_kv_heads"], c["head_dim"], batch, cap)
        return {"session": sid, "kv_bytes": need}

    def do_session_reorder(self, ident, rid, h, arrays):
        sess = self._session(h.get("session"))
        sess.reorder(h.get("indices") if isinstance(h.get("indices"), list) else [])
        return {"session": h["session"], "batch": sess.batch, "length": sess.length}

    def do_close_session(self, ident, rid, h, arrays):
        sess = self._session(h.get("session"))
        sess.close()
        del self.sessions[h["session"]]
        return {}

    def _busy(self, sess: KVSession) -> bool:
        return any(r.session is sess for r in self.runs.values())

    def _session(self, sid) -> KVSession:
        sess = self.sessions.get(sid) if isinstance(sid, str) else None
        if sess is None:
            raise ProtocolError("unknown_session", f"no session {str(sid)[:20]!r}; open_session first")
        if self._busy(sess):
            raise ProtocolError("busy", "the session has a run in flight")
        return sess

    def _off_loop(self, ident, rid, name: str, work, commit) -> None:
        """Run work() on a thread (long, CPU-bound) so the loop keeps answering; its result or exception comes
        back through the outbox, where the loop applies commit(result) -> reply fields and sends the reply."""
        def worker():
            try:
                result = work()
            except BaseException as e:  # delivered to the loop, which replies with it
                result = e
            self.outbox.put(("done", ident, rid, result, commit))
        self.workers.submit(worker)

    def do_put_plan(self, ident, rid, h, arrays):
        raw = h.get("plan")

        def work():  # reads only the message, the store and the lanes: nothing the loop changes
            plan = validate(raw, self.store.has, self.lanes)
            return _content_id(raw), plan

        def commit(result):
            plan_id, plan = result
            # a plan put again (each connection and decode session puts its own copy) keeps the first copy: the
            # runner cache remembers records and fused ops per object, so every copy stayed alive through it
            # (~2,800 objects a generate for SmolLM2), and the GC's full passes walked them all
            plan = self.plans.setdefault(plan_id, plan)
            return {"plan_id": plan_id, "ops": len(plan.order),
                    "lanes": {k: len(v) for k, v in plan.lane_order.items()}}
        self._off_loop(ident, rid, "plan", work, commit)
        return None  # validated off the loop; the loop files it and replies

    def do_cancel(self, ident, rid, h, arrays):
        target = h.get("target")
        r = self.runs.get((ident, target)) if isinstance(target, int) else None
        if r is None:
            raise ProtocolError("unknown_target", f"no run with id {str(target)[:20]!r} in flight for this client")
        r.cancel.set()
        return {"cancelled": target}

    def do_run(self, ident, rid, h, arrays):
        plan = self.plans.get(h.get("plan_id")) if isinstance(h.get("plan_id"), str) else None
        if plan is None:
            raise ProtocolError("unknown_plan", f"no plan {str(h.get('plan_id'))[:20]!r}; send it with put_plan first")
        names = h.get("inputs", [])
        if not isinstance(names, list) or len(names) != len(arrays) or not all(isinstance(n, str) for n in names):
            raise ProtocolError("bad_request", "run needs 'inputs': one name per attached frame")
        if (ident, rid) in self.runs:
            raise ProtocolError("bad_id", f"request id {rid} is already running")
        steps, keep = h.get("steps", 1), h.get("keep", "last")
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
            raise ProtocolError("bad_request",
                                f"'steps' must be an integer from 1 to {MAX_STEPS}, got {str(steps)[:20]}")
        if keep not in ("last", "all"):
            raise ProtocolError("bad_request", f"'keep' must be 'last' or 'all', got {str(keep)[:20]!r}")
        loop = "steps" in h  # a decode loop, even of one step: its reply has the loop's form (fed, step_counters)
        if loop and (h.get("session") is None or h.get("phase") != "decode" or len(names) != 1
                          or len(plan.outputs) != 1 or plan.outputs[0] == "fed"):
            raise ProtocolError("bad_request", "a run with 'steps' is a greedy decode loop: it needs a session, "
                                               "phase 'decode', one input (the first step's tokens) and a plan with "
                                               "one output (the logits), not named 'fed'")
        sess, advance = None, 0
        if h.get("session") is not None:
            sess = self._session(h.get("session"))
            advance = h.get("advance")
            if not isinstance(advance, int) or isinstance(advance, bool) or advance < 1:
                raise ProtocolError("bad_request", "a run in a session needs 'advance', the positions it adds (>= 1)")
            if h.get("phase") == "decode" and sess.length == 0:
                raise ProtocolError("no_prefill", "decode step on an empty session: prefill the prompt first")
            if sess.length + advance * steps > sess.capacity:
                raise ProtocolError("context_full", f"{sess.length + advance * steps} positions exceed the session's "
                                                    f"capacity {sess.capacity}")
        try:  # None unless asked; a pattern naming no op, or a malformed field, refused before the run
            capture = Capture.of_request(h.get("numerics"), capture_names(plan) if "numerics" in h else ())
        except CaptureError as e:
            raise ProtocolError(e.code, str(e)) from None
        run = _Run(rid, ident, session=sess, advance=advance * steps, steps=steps, keep=keep, loop=loop)
        inputs = {n: np.array(a) for n, a in zip(names, arrays)}  # own the bytes: frames are recycled
        self.runs[(ident, rid)] = run
        try:
            self.workers.submit(self._run_worker, run, plan, inputs, capture)
        except BaseException:
            del self.runs[(ident, rid)]  # no worker: the error reply below is this request's one reply
            raise
        return None  # the worker hands its final reply to the loop

    @staticmethod
    def _steps(run: _Run, plan, inputs, ctx: Context, on_op, flash: _FlashLog) -> tuple[dict, list, dict]:
        """The run's passes of the plan on this thread: one, or the `steps` of a greedy decode loop, each fed the
        argmax of the last one's logits float32[batch, vocab] as int32[batch], at the next positions of the session
        (whose length the loop moves on only after the whole run: a failed step leaves the cache as it was). A loop's
        events carry "step"; its reply adds "fed" int32[batch, steps] (every step's tokens) and "step_counters"."""
        if not run.loop:
            outs, events = execute(plan, inputs, ctx, run.cancel, on_op)
            return outs, events, {}
        (name,), (out,) = list(inputs), plan.outputs
        tokens = np.asarray(inputs[name]).reshape(-1).astype(np.int32)
        per = run.advance // run.steps
        events, kept, fed, step_counters, seen = [], [], [], [], 0
        for i in range(run.steps):
            step_ctx = replace(ctx, counters={}, offset=i * per)  # this step's positions, its own counters
            if ctx.numerics is not None:  # each step's summaries apart
                ctx.numerics.step = i
            outs, evs = execute(plan, {name: tokens}, step_ctx, run.cancel, on_op)
            fed.append(tokens)
            logits = outs[out]
            if logits.ndim != 2 or logits.shape[0] != tokens.shape[0]:
                raise OpError("bad_plan", f"a decode loop feeds each step the argmax of the plan's output, which must "
                                          f"be float[batch={tokens.shape[0]}, vocab]; it is {list(logits.shape)}")
            tokens = np.argmax(logits, axis=-1).astype(np.int32)  # the host's greedy sample(): the first maximum
            new = flash.events()[seen:]
            seen += len(new)
            for e in evs + new:  # this run's own event dicts: tagged in place, ~2,200 of them in a 64-step loop
                e["step"] = i
            events += evs + new
            kept.append(logits)
            for k, v in step_ctx.counters.items():
                ctx.counters[k] = ctx.counters.get(k, 0) + v
            step_counters.append({k: int(v) for k, v in step_ctx.counters.items()})
        flash.skip(seen)  # already in the events, with their steps
        outs = {out: np.stack(kept) if run.keep == "all" else kept[-1], "fed": np.stack(fed, axis=1)}
        return outs, events, {"step_counters": step_counters}

    def _run_worker(self, run: _Run, plan, inputs, capture=None) -> None:
        """Runs on its own thread; hands the loop exactly one ("run_done", ...) item, whatever happens."""
        header, arrays = error_reply(run.rid, "internal", "the run ended without a result"), ()
        total = len(plan.order) * run.steps
        # progress every 0.2 s of a long run; none for a short one (a decode step), whose final reply says it all
        state = {"done": 0, "last": time.monotonic()}  # touched by on_op alone, which execute calls under its lock

        def on_op(ev):
            state["done"] += 1
            if state["done"] & 7:  # the clock every 8th op: a decode step's 33 ops paid ~3 us each for it
                return
            t = time.monotonic()
            if t - state["last"] > 0.2:
                state["last"] = t
                self.outbox.put(("send", run.ident, pack({"id": run.rid, "final": False, "event": "progress",
                                                          "done": state["done"], "total": total})))
        try:
            flash = _FlashLog()
            get = partial(self.store.get, on_read=flash.add)
            ctx = Context(get=get if self.store.memory_budget is not None else _per_run(get), counters={},
                          runners=self.runners, session=run.session,
                          read_rows=partial(self.store.read_rows, on_read=flash.add),
                          read_blob=partial(self.store.read_cold, on_read=flash.add), map_blob=self.store.map,
                          blob_meta=self.store.meta, layout=partial(self.store.layout, on_read=flash.add),
                          backends={"npu": self.npu_backend}, kernels=self.kernels, emulated=self.emulated,
                          blob_args={} if run.loop and self.store.memory_budget is None else None, numerics=capture)
            t0 = now_us()
            try:
                with self.store.running(), CORES_IN_USE.running():
                    outs, events, more = self._steps(run, plan, inputs, ctx, on_op, flash)
            finally:
                if run.session is not None:
                    run.session.settle()  # reads this run started (expert preloads) end before its reply
            t1 = now_us()
            header = {"id": run.rid, "final": True, "ok": True, "outputs": list(outs),
                      "events": events + flash.events(), "counters": {k: int(v) for k, v in ctx.counters.items()},
                      "start_us": t0, "end_us": t1, **more}
            arrays = [np.ascontiguousarray(a) for a in outs.values()]
            if capture is not None:  # summaries in the header, full tensors as frames after the outputs'
                header["numerics"], full = capture.reply()
                arrays += full
        except Cancelled:
            header = error_reply(run.rid, "cancelled", "the run was cancelled")
        except AgentError as e:
            header = error_reply(run.rid, e.code, str(e))
        except BaseException as e:  # a worker must end with a reply, whatever broke
            header = error_reply(run.rid, "internal", f"{type(e).__name__}: {e}")
        finally:
            self.outbox.put(("run_done", run, header, arrays))
