"""python -m edgeprobe_agent --bind tcp://127.0.0.1:5555 --store DIR [--memory-budget MB] [--curve-keys DIR]
[--npu-backend numba|hvx]"""
import gc
import os

# A lane stands for one processor: kernels run single-threaded so concurrent lanes do not oversubscribe cores.
# EDGEPROBE_LANE_THREADS=auto: an op computing alone gets every core (threads.py), so numba's pool holds them all;
# fast on an idle machine, but 2-thread kernels collapse when other processes share the cores: opt-in.
LANE_THREADS = os.environ.get("EDGEPROBE_LANE_THREADS", "1")
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("NUMBA_NUM_THREADS", str(len(os.sched_getaffinity(0)) if LANE_THREADS == "auto" else 1))
# OpenBLAS's idle workers spin 2^16 cycles (~20 us), not 2^28 (~0.1 s), after a call: enough to bridge back-to-back
# BLAS calls without taking a core from the numba kernel that runs next (with 2-thread BLAS, auto)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")
# numba's threading layer (bench/threading_layers.py measures the two): at one thread a lane OpenMP, level with TBB
# on a quiet machine and faster beside busy processes (2026-11-23, 5715354). With EDGEPROBE_LANE_THREADS=auto (the
# idle machine's mode) TBB where the tbb wheel is installed (edgeprobe_kernels picks it, as for host processes): on
# the AVX-512 EPYC at 70ec361 a 64-token w8a8-shadow prefill took 49 against 67 ms quiet and 114 against 125 beside
# two busy processes, decode steps 1.17-1.43x faster quiet, level (w8a8) or 0.68x (q4_0-tile) beside them
if LANE_THREADS != "auto":
    os.environ.setdefault("NUMBA_THREADING_LAYER", "omp")


# mallopt's parameters (malloc.h) and what the agent sets them to, unless the user's environment names them
MALLOC_SETTINGS = (
    (-8, "MALLOC_ARENA_MAX", 1),                 # M_ARENA_MAX
    (-3, "MALLOC_MMAP_THRESHOLD_", 64 << 20),    # M_MMAP_THRESHOLD
    (-1, "MALLOC_TRIM_THRESHOLD_", 256 << 20),   # M_TRIM_THRESHOLD
    (-2, "MALLOC_TOP_PAD_", 64 << 20),           # M_TOP_PAD
)


def _malloc_settings() -> dict:
    """glibc only (not a phone's bionic): one malloc arena and high mmap/trim thresholds, so ops' arrays reuse warm
    pages instead of faulting in fresh ones every run (lane threads are new each run, and each would get an arena;
    arrays under 64 MB would be mapped and unmapped one by one). The agent keeps its peak working set, as llama.cpp
    keeps its compute buffers. A setting named in the environment (or any GLIBC_TUNABLES) is the user's. Returns
    the settings made, {environment name: value}."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc" or "GLIBC_TUNABLES" in os.environ:
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    return {env: value for param, env, value in MALLOC_SETTINGS
            if env not in os.environ and mallopt(param, value) == 1}  # before any other thread allocates


MALLOC = _malloc_settings()


def _file_table(table: int = 4096, limit: int = 1 << 16) -> dict:
    """Raise the soft limit on open files towards `limit` (as far as the hard limit allows) and size this process's
    file table for `table` descriptors now, while it has one thread. Every memory-mapped blob and layout holds a
    descriptor (Python's mmap keeps a dup of it): a model's first prefill maps ~200-380, so under the usual soft
    limit of 1024 the fifth scheme loaded in one agent failed its run with EMFILE (Too many open files). And a
    table grown later, with the lane, ZeroMQ and store threads sharing it, waits out an RCU grace period
    (synchronize_rcu) at each doubling, on whichever lane opened the file. Returns {"limit", "table"} as made."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        inf = resource.RLIM_INFINITY
        if soft != inf and soft < limit and (hard == inf or hard > soft):
            soft = limit if hard == inf else min(limit, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        top = (table if soft == inf else min(table, soft)) - 1
        fd = os.open(os.devnull, os.O_RDONLY)
        try:
            os.dup2(fd, top)  # the table grows to hold descriptor `top`, once; closing it keeps the size
            os.close(top)
        finally:
            os.close(fd)
        return {"limit": -1 if soft == inf else soft, "table": top + 1}
    except (ImportError, OSError, ValueError):
        return {}  # the limit stays as it was: more than ~1000 mappings then fail with a clear EMFILE


FILES = _file_table()

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from edgeprobe_kernels.paths import cache_root  # noqa: E402 - after the thread settings above

# what the agent imports, as (module, pip name); numba and pyopencl are optional (numpy kernels; no gpu lane)
REQUIRED = (("numpy", "numpy"), ("zmq", "pyzmq"), ("msgpack", "msgpack"))
INSTALL_HINT = ("pip install {pips}  (on a phone, in Termux: pkg install python python-numpy libzmq; "
                "pip install pyzmq msgpack)")


def missing_packages() -> list[str]:
    """The pip names of REQUIRED packages this Python cannot import (checked before any of them is imported)."""
    import importlib.util

    return [pip for mod, pip in REQUIRED if importlib.util.find_spec(mod) is None]


def _warm() -> None:
    """Load the numba kernels from numba's cache, so that the first run computes instead of loading them."""
    try:
        from edgeprobe_kernels.warm import warm

        warm()
    except Exception as e:  # a cold kernel is slower, not wrong: say so and serve anyway
        print(f"edgeprobe-agent: warming the kernels failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="edgeprobe_agent", description="edgeprobe device agent (ZeroMQ ROUTER)")
    ap.add_argument("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint; port * picks a free one")
    ap.add_argument("--store", default=str(cache_root() / "agent-store"),
                    help="blob store directory (the device's flash; default <edgeprobe cache>/agent-store: "
                         "$EDGEPROBE_CACHE, else ~/.cache/edgeprobe)")
    ap.add_argument("--memory-budget", type=float, default=None, help="MB of blobs kept resident (default: all)")
    ap.add_argument("--curve-keys", help="folder with server.key_secret (zmq.auth); required off loopback")
    ap.add_argument("--lanes", help="comma-separated lanes to offer, e.g. cpu,npu (default: cpu, npu, and gpu where "
                                    "OpenCL is found)")
    ap.add_argument("--npu-backend", default="numba", choices=["numba", "hvx"],
                    help="kernels of the npu lane: numba (NPU semantics on this CPU) or hvx (Hexagon v67 HVX machine "
                         "code under qemu-hexagon; needs clang-15, lld-15, qemu-user)")
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="stop when this process is gone (Device.local passes its own pid, so a killed host leaves no "
                         "agent holding the store)")
    args = ap.parse_args(argv)
    missing = missing_packages()
    if missing:  # a bare phone: say what to install, not a traceback from deep inside an import
        print(f"edgeprobe-agent: error: this Python ({sys.executable}, {'.'.join(map(str, sys.version_info[:3]))}) "
              f"lacks {', '.join(missing)}; install: {INSTALL_HINT.format(pips=' '.join(missing))}", file=sys.stderr)
        return 2
    from .server import Agent

    secret = public = None
    if args.curve_keys:
        import zmq.auth

        public, secret = zmq.auth.load_certificate(str(Path(args.curve_keys) / "server.key_secret"))
    try:
        agent = Agent(args.bind, args.store, None if args.memory_budget is None else int(args.memory_budget * 1e6),
                      curve_secret=secret, curve_public=public,
                      lanes=None if args.lanes is None else [l for l in args.lanes.split(",") if l],
                      parent_pid=args.parent_pid, npu_backend=args.npu_backend)
    except Exception as e:
        print(f"edgeprobe-agent: error: {e}", file=sys.stderr)
        return 2
    agent.malloc, agent.files = dict(MALLOC), dict(FILES)  # hello reports them
    signal.signal(signal.SIGTERM, lambda *a: setattr(agent, "_stop", True))
    # kernels loaded before the agent says it listens (~0.45 s here): on a thread beside the first run they slowed
    # it by 0.3 s (800 ms against 500 ms for a 64-token prefill), and a run is what the agent is measured on
    _warm()
    # what is alive now (modules, numba's and llvmlite's objects, ~200,000) lives as long as the process: out of
    # the GC's sight, a full collection during a run walks only what runs made (28 ms each here before, ~1 after)
    gc.freeze()
    print(f"edgeprobe-agent listening on {agent.url}", flush=True)
    if LANE_THREADS == "auto":
        from .threads import CORES_IN_USE

        CORES_IN_USE.enable()
    try:
        agent.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
