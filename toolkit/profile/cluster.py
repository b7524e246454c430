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

import os
import socket
import sys
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


def profile_shard(ref: str, sha256: str, kind: str, empty: bytes, ids: np.ndarray, window: int, index: int) -> dict:
    """One Ray task: stream ids (int32[windows * window]) into the empty profile (its .npz bytes) -> its bytes and
    where and how long it ran. Runs on a worker; imports only what a worker with edgeprobe installed has."""
    started, t0 = time.time(), time.perf_counter()
    model, load_s = _worker_model(ref, sha256)
    st = _kinds()[kind].load(empty)
    run(model, ids, st, window=window, progress=False)
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


class RayRunner:
    """runner.run's call shape, on a Ray cluster: `RayRunner(address)(model, ids, profile, window=..., ...)`.

    address: "local" (a cluster of this machine's cores, started here and stopped on close), "auto", HOST:PORT of a
    running head, or ray://HOST:PORT (Ray Client). shards: how many shards a pass is cut into (default 4 per CPU of
    the cluster, at most one per window). num_cpus: a local cluster's CPUs (default all). Every node needs edgeprobe
    and the model (built-in names resolve on the node; a path must exist there). `reports` lists every shard run."""

    def __init__(self, address: str = "local", shards: int | None = None, num_cpus: int | None = None,
                 max_retries: int = 3, say=None):
        if shards is not None and (not isinstance(shards, (int, np.integer)) or shards < 1):
            raise ClusterError(f"--shards must be a positive number of shards, got {shards!r}")
        self.address, self.shards, self.max_retries = address, shards, max_retries
        self.say = say or (lambda m: print(f"edgeprobe: {m}", file=sys.stderr, flush=True))
        self.reports: list[ShardReport] = []
        self._owned = False  # whether close() stops or leaves a connection this runner made
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
        try:
            if address == "local":
                ray.init(num_cpus=num_cpus or os.cpu_count(), object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                         include_dashboard=False, log_to_driver=True, configure_logging=False)
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __call__(self, model: Model, ids, profile: Profile, window: int = 512, max_tokens: int | None = None,
                 progress: bool = True, desc: str = "profile") -> Profile:
        """Stream `ids` (int[tokens]) into `profile` on the cluster, shard by shard: as runner.run(...) does, the
        profile gains the windows (in place) and is returned; every shard starts from its empty() twin."""
        from tqdm.auto import tqdm

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
                                        window, nxt)] = nxt
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
