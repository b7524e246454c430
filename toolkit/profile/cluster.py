"""Profiles sharded over a Ray cluster: the corpus's windows cut into contiguous shards, one Ray task each.

A task gets the model's built-in name or path (never the model), the shard's token ids and the empty profile
as the bytes of its .npz file (store.py); its worker loads the model once from the weight cache, keeps it for
its later tasks, streams the shard's windows through `runner.run` and answers with the profile's .npz bytes.
The driver merges the shards in corpus order with `Profile.merge`, so the result equals one pass over the same
windows: counts exactly, float sums to rounding (an error, the router entropy) and float maxima to BLAS's
thread-count-dependent rounding.

A worker killed mid-shard is retried by Ray (`max_retries`): the shard runs again from its first window on
another worker, and only a finished shard's answer is merged, so nothing is lost or counted twice.

    with RayRunner("local") as ray_run:                # or "127.0.0.1:6379", "ray://head:10001", "auto"
        st = ray_run(model, ids, OutlierStats.for_model(model, clips), window=512, max_tokens=1 << 20)
    # the same call shape as runner.run, so jobs.profile_outliers(..., runner=ray_run) shards every pass
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from ..errors import ClusterError, EdgeprobeError
from ..models import BUILTIN, Model
from .base import Profile
from .runner import run, windows

RAY_MISSING = ("profiling on Ray needs the ray package: pip install 'edgeprobe[ray]' (make test and make setup-test "
               "install it)")
LOCAL_OBJECT_STORE_BYTES = 200_000_000  # shards answer with a few MB each: a small store leaves memory to the model
# The raylet gives its dashboard agent a fixed 15 s to write its port file and aborts past it (Ray issue 65983): on
# busy cores the agent's imports can take longer. Only that failure is worth another start, with new ports.
AGENT_PORT_FILE_TIMEOUT = "Timed out waiting for file"
HEAD_STARTS = 3


def _kinds() -> dict[str, type[Profile]]:
    """KIND -> profile class: how a worker rebuilds the empty profile it was sent."""
    from .experts import CoActivationStats
    from .outliers import ClipHistograms, OutlierStats
    from .sparsity import SparsityStats

    return {c.KIND: c for c in (ClipHistograms, OutlierStats, SparsityStats, CoActivationStats)}


# ---- the worker's side ------------------------------------------------------------------------------
_MODELS: dict[tuple[str, str], Model] = {}  # (name or path, sha256) -> model; a Ray worker runs one task at a time


def _worker_model(ref: str, sha256: str) -> tuple[Model, float]:
    """The model this worker process loaded before, or load it now: (model, seconds spent loading)."""
    from .. import models

    key = (ref, sha256)
    if key in _MODELS:
        return _MODELS[key], 0.0
    t0 = time.perf_counter()
    model = models.load(ref)
    if model.sha256 != sha256:
        raise ClusterError(f"the model {ref!r} on {socket.gethostname()} has sha256 {model.sha256[:12]}, the driver's "
                           f"has {sha256[:12]}: install the same checkpoint (and edgeprobe) on every node")
    _MODELS.clear()  # one model per worker: a second job's model replaces the first's
    _MODELS[key] = model
    return model, time.perf_counter() - t0


def profile_shard(ref: str, sha256: str, kind: str, empty: bytes, ids: np.ndarray, window: int, index: int,
                  order: str = "window") -> dict:
    """One Ray task: stream ids (int32[windows * window]) into the empty profile (its .npz bytes), in runner.run's
    `order`, -> its bytes and where and how long it ran. Runs on a worker; imports only what a worker with edgeprobe
    installed has."""
    started, t0 = time.time(), time.perf_counter()
    model, load_s = _worker_model(ref, sha256)
    st = _kinds()[kind].load(empty)
    run(model, ids, st, window=window, progress=False, order=order)
    return {"profile": st.to_bytes(), "index": index, "pid": os.getpid(), "host": socket.gethostname(),
            "started": started, "load_s": load_s, "seconds": time.perf_counter() - t0}


# ---- the driver's side ------------------------------------------------------------------------------
@dataclass
class ShardReport:
    """Where one shard ran: windows [first, last), the worker's pid and host, when its task started (Unix time) and
    its seconds (model load included), of which loading the model (0 when the worker had it), and bytes of the
    answer. A retried shard is reported once, by the attempt that finished."""

    index: int
    first: int
    last: int
    pid: int
    host: str
    started: float
    seconds: float
    load_s: float
    answer_bytes: int


def model_ref(model: Model) -> str:
    """What a worker loads: the built-in name, else the checkpoint's path (which every node must have)."""
    if model.name in BUILTIN:
        return model.name
    if model.source and Path(model.source).exists():
        return str(model.source)
    raise ClusterError(f"the model {model.name or model.config.name!r} was not loaded from a checkpoint (source "
                       f"{model.source!r}); Ray workers load models by built-in name or path: save it as GGUF "
                       "(edgeprobe.models.gguf_writer.write_gguf) and load that file")


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, naming the address, when nothing listens there (ray.init would retry for a minute)."""
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"--ray {address!r}: write local, auto, HOST:PORT (the head's GCS port, 6379 by default) "
                           "or ray://HOST:PORT (Ray Client, 10001 by default)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterError(f"no Ray cluster answers at {address} ({e.strerror or e}); start one with "
                           "`ray start --head` there, or use --ray local for a cluster of this machine's cores") \
            from None


def _token_auth() -> None:
    """A cluster started by `ray start` wants its token; Ray finds it by itself only for address "auto", so turn
    token mode on when a token is at hand (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    if os.environ.get("RAY_AUTH_TOKEN") or Path(path).is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def start_is_retried(why: str) -> bool:
    """Whether a failed `ray start --head` is started again with new ports: only when the raylet aborted because its
    dashboard agent wrote no port file in time (AGENT_PORT_FILE_TIMEOUT in `why`: the head's output, the raylet
    log's error lines and tail). Any other failure would fail again the same way."""
    return AGENT_PORT_FILE_TIMEOUT in why


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """A preexec_fn (Linux) that has the head's process SIGTERMed when the thread that started it dies, so a killed
    driver leaves no cluster behind (--block stops the processes it started on SIGTERM); None elsewhere. prctl is
    looked up here, in the parent: the child between fork and exec only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


class HeadStartError(ClusterError):
    """`ray start --head` did not start; `why` holds its output and the raylet log's error lines (several lines)."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


@dataclass
class LocalHead:
    """A Ray head on 127.0.0.1 started by start_head: its `ray start --head --block` process (stopped by its PID,
    never `ray stop`, which stops every cluster of the machine), its temp dir and ports."""

    proc: subprocess.Popen
    temp: Path
    gcs_port: int
    client_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def client(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM (--block then stops the processes it started), SIGKILL to its process group past timeout_s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        shutil.rmtree(self.temp, ignore_errors=True)


def _raylet_errors(text: str) -> str:
    """A raylet log's error and fatal lines (glog's "[time E|C|F pid tid]", failed checks), wherever they are, then
    its last 2000 characters: a fatal check's stack trace alone can fill more than that tail."""
    import re

    errors = [x for x in text.splitlines() if re.match(r"\[[^\]]* [ECF] \d+ \d+\]", x) or "Check failed" in x]
    return "\n".join(errors[-20:] + [text[-2000:]])


def _start_head_once(num_cpus: int, object_store_bytes: int, env: dict, timeout_s: float) -> tuple[LocalHead, str]:
    """One `ray start --head --block` on free ports -> (head, "" or why it did not start: its output, the raylet
    log's error lines and tail). A start that failed has its process group (GCS, raylet) killed."""
    # short: Ray's unix sockets live below it (108 bytes at most)
    temp = Path(tempfile.mkdtemp(prefix="epray-", dir="/tmp" if os.path.isdir("/tmp") else None))
    gcs, client = _free_port(), _free_port()
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin)] if ray_bin.exists() else [sys.executable, "-m", "ray.scripts.scripts"]
    cmd += ["start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
            "--num-cpus", str(num_cpus), "--object-store-memory", str(object_store_bytes), "--include-dashboard",
            "false", "--disable-usage-stats", "--temp-dir", str(temp), "--ray-client-server-port", str(client)]
    for flag in ("--dashboard-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                 "--runtime-env-agent-port", "--metrics-export-port"):
        cmd += [flag, str(_free_port())]  # Ray's fixed defaults would collide with another cluster on this machine
    log = temp / "head.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent())
    head = LocalHead(proc, temp, gcs, client)
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its GCS and raylet too, left from a start cut short
            proc.wait(timeout=10)
            raylet = "".join(_raylet_errors(p.read_text(errors="replace")) for name in ("raylet.out", "raylet.err")
                             for p in temp.glob(f"session_*/logs/{name}"))  # the abort's reason is only there
            return head, log.read_text(errors="replace")[-3000:] + raylet
        time.sleep(0.2)
    return head, ""


def start_head(num_cpus: int | None = None, object_store_bytes: int = LOCAL_OBJECT_STORE_BYTES,
               env: dict | None = None, starts: int = HEAD_STARTS, timeout_s: float = 180, say=None) -> LocalHead:
    """A Ray head of this machine on 127.0.0.1 (`ray start --head --block`: num_cpus CPUs, default all; no dashboard;
    its own free ports and temp dir), started up to `starts` times when start_is_retried says so, with new ports.
    env: the head's environment (default os.environ). Raises HeadStartError (why: the last start's logs)."""
    if not _ray_installed():
        raise ClusterError(RAY_MISSING)
    env = {**os.environ} if env is None else env
    say = say or (lambda m: None)
    attempt = 1
    while True:
        head, why = _start_head_once(num_cpus or os.cpu_count() or 1, object_store_bytes, env, timeout_s)
        if not why:
            return head
        shutil.rmtree(head.temp, ignore_errors=True)
        if not start_is_retried(why) or attempt >= starts:
            raise HeadStartError(f"`ray start --head` did not start: {_reason(why)}", why)
        attempt += 1
        say(f"ray: the head's dashboard agent wrote no port file in Ray's 15 s (Ray issue 65983, busy cores); "
            f"starting it again on new ports ({attempt}/{starts})")


def _reason(why: str) -> str:
    """One line of a failed start's logs: its error lines (Ray's exception, the raylet's failed check), not the
    stack traces around them; at most 600 characters."""
    import re

    lines = [" ".join(line.split()) for line in why.splitlines()]
    errors = [x for x in lines if re.search(r"Check failed|Timed out|Error|Exception|FATAL", x)
              and not x.startswith(("raise ", "File "))]  # a traceback's source lines name the error too
    picked = list(dict.fromkeys(errors))[-3:] or [x for x in lines if x][-2:]
    return " | ".join(picked)[:600]


def _ray_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


class RayRunner:
    """runner.run's call shape, on a Ray cluster: `RayRunner(address)(model, ids, profile, window=..., ...)`.

    address: "local" (a cluster of this machine's cores: a head started by start_head, stopped on close), "auto",
    HOST:PORT of a running head, or ray://HOST:PORT (Ray Client). shards: how many shards a pass is cut into (default
    4 per CPU of the cluster, at most one per window). num_cpus: a local cluster's CPUs (default all). Every node
    needs edgeprobe and the model (built-in names resolve on the node; a path must exist there). `reports` lists
    every shard run."""

    def __init__(self, address: str = "local", shards: int | None = None, num_cpus: int | None = None,
                 max_retries: int = 3, say=None):
        if shards is not None and (not isinstance(shards, (int, np.integer)) or shards < 1):
            raise ClusterError(f"--shards must be a positive number of shards, got {shards!r}")
        self.address, self.shards, self.max_retries = address, shards, max_retries
        self.say = say or (lambda m: print(f"edgeprobe: {m}", file=sys.stderr, flush=True))
        self.reports: list[ShardReport] = []
        self._owned = False  # whether close() stops or leaves a connection this runner made
        self._head: LocalHead | None = None  # the local cluster's head this runner started (address "local")
        self._task = None  # profile_shard as a Ray task, made once connected
        self._ray = self._connect(address, num_cpus)

    def _connect(self, address: str, num_cpus: int | None):
        if address != "local" and address != "auto":
            _reachable(address)
            _token_auth()  # before ray is imported: it reads its auth mode then
        elif "ray" not in sys.modules:
            # a cluster of this machine's cores listens on loopback only (Ray's own switch for single-node clusters)
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray
        except ImportError:
            raise ClusterError(RAY_MISSING) from None
        if ray.is_initialized():  # a notebook's own connection: use it, leave it open
            return ray
        t0 = time.perf_counter()
        if address == "local":  # the head the e2e tests' ray_cluster starts too, with the same retry
            self._head = start_head(num_cpus, LOCAL_OBJECT_STORE_BYTES, say=self.say)
        try:
            if address == "local":
                try:
                    ray.init(address=self._head.address, log_to_driver=True, configure_logging=False)
                except BaseException:
                    self._head.stop()
                    self._head = None
                    raise
            else:
                try:
                    ray.init(address=address, log_to_driver=True, configure_logging=False)
                except ConnectionError as e:
                    if not address.startswith("ray://") or "Initialization failure" not in str(e):
                        raise
                    # Ray Client's server starts a driver process per client; on a busy head that start can fail
                    # once (seen on a fresh cluster under load): try once more, and say so
                    self.say(f"ray: the Ray Client server at {address} failed to start our session; trying once more")
                    ray.shutdown()
                    ray.init(address=address, log_to_driver=True, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            why = " ".join(str(e).split())[:600]  # Ray's reasons span lines; one line, bounded
            raise ClusterError(f"could not join the Ray cluster at {address}: {why} (a cluster started with token "
                               "authentication wants its token in RAY_AUTH_TOKEN or ~/.ray/auth_token)") from None
        self._owned = True
        res = ray.cluster_resources()
        self.say(f"ray: {'started a local cluster' if address == 'local' else f'joined {address}'} with "
                 f"{res.get('CPU', 0):g} CPUs on {len([n for n in ray.nodes() if n.get('Alive')])} node(s) in "
                 f"{time.perf_counter() - t0:.1f} s")
        return ray

    @property
    def cpus(self) -> int:
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    def close(self) -> None:
        """Disconnect (and stop a local cluster this runner started)."""
        if self._owned:
            self._ray.shutdown()
            self._owned = False
        if self._head is not None:
            self._head.stop()
            self._head = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __call__(self, model: Model, ids, profile: Profile, window: int = 512, max_tokens: int | None = None,
                 progress: bool = True, desc: str = "profile", order: str = "window") -> Profile:
        """Stream `ids` (int[tokens]) into `profile` on the cluster, shard by shard: as runner.run(...) does, the
        profile gains the windows (in place) and is returned; every shard starts from its empty() twin. order:
        runner.run's, per shard ("layer": a worker reads each layer's weights once for its windows)."""
        from tqdm.auto import tqdm

        if order not in ("window", "layer"):
            raise ValueError(f"order must be 'window' or 'layer', got {order!r}")
        ray = self._ray
        chunks = windows(ids, window, max_tokens)
        n = len(chunks)
        cpus = self.cpus  # asked once per pass: the cluster may grow or shrink between passes
        k = min(n, self.shards or 4 * cpus)
        bounds = [(n * i // k, n * (i + 1) // k) for i in range(k)]
        ids = np.asarray(ids, np.int32)
        if self._task is None:  # one CPU, so one BLAS thread, per shard; a dead worker's shard runs again
            self._task = ray.remote(num_cpus=1, max_retries=self.max_retries)(profile_shard)
        task = self._task
        ref = model_ref(model)
        empty_ref = ray.put(profile.empty().to_bytes())  # one copy in the object store, read by every task
        merged, done, pending, results = profile, 0, {}, {}
        t0 = time.perf_counter()
        bar = tqdm(total=k, desc=f"{desc} on ray", unit="shard", disable=not progress, leave=False)
        try:
            nxt = 0
            while done < k:
                while nxt < k and len(pending) + len(results) < 2 * cpus + 1:  # bounded memory on the driver
                    lo, hi = bounds[nxt]
                    pending[task.remote(ref, model.sha256, profile.KIND, empty_ref, ids[lo * window:hi * window],
                                        window, nxt, order)] = nxt
                    nxt += 1
                ready, _ = ray.wait(list(pending), num_returns=1)
                i = pending.pop(ready[0])
                try:
                    results[i] = ray.get(ready[0])
                except ray.exceptions.RayTaskError as e:  # an error in our code on the worker: not retried
                    cause = getattr(e, "cause", None)
                    why = str(cause) if isinstance(cause, EdgeprobeError) else str(e).strip().splitlines()[-1]
                    raise ClusterError(f"{desc} shard {i} (windows {bounds[i][0]}-{bounds[i][1] - 1}) failed on the "
                                       f"cluster: {why}") from None
                except ray.exceptions.RayError as e:  # its worker died on every one of Ray's tries
                    why = str(e).strip().splitlines()[0]
                    raise ClusterError(f"{desc} shard {i} was lost with its worker {self.max_retries + 1} times "
                                       f"({why}); check the nodes' memory and logs") from None
                bar.update(1)
                while done in results:  # merge in corpus order, so the result is one pass's
                    r = results.pop(done)
                    merged = merged.merge(type(profile).load(r["profile"]))
                    self.reports.append(ShardReport(done, *bounds[done], r["pid"], r["host"], r["started"],
                                                    r["seconds"], r["load_s"], len(r["profile"])))
                    done += 1
        except BaseException:
            for r in pending:
                ray.cancel(r, force=True)
            raise
        finally:
            bar.close()
        for f in fields(profile):  # in place, as runner.run
            setattr(profile, f.name, getattr(merged, f.name))
        got = self.reports[-k:]
        self.say(f"{desc}: {k} shards of {n} windows on {len({(r.host, r.pid) for r in got})} workers in "
                 f"{time.perf_counter() - t0:.1f} s (median shard {np.median([r.seconds for r in got]):.2f} s)")
        return profile

    def summary(self) -> dict:
        """Every shard this runner ran, for shards.json: address, shards, workers, seconds."""
        return {"address": self.address, "shards": [asdict(r) for r in self.reports],
                "workers": len({(r.host, r.pid) for r in self.reports}),
                "hosts": sorted({r.host for r in self.reports})}
