"""The one thread policy: how many cores a host pass (eval, calibration, profiles) or an agent lane's lone op may use.

A kernel whose threads spin while they wait (OpenBLAS's own threading, numba's OpenMP teams) splits its work evenly
and waits for its slowest thread: beside one CPU-bound process a 2-thread pass on 2 cores kept 0.68x of its quiet
one-thread speed, beside a 2-thread BLAS job 0.1-0.2x. So the policy counts the cores other processes keep busy
(/proc/stat's busy time on this process's cores minus this process's own CPU time, over the last ~0.25 s; in the
agent over the last ~0.25 s of its runs, not the time it waits for a request) and gives such kernels the rest: all
cores on a quiet machine, one beside a hog. Host passes enter `host_pass()` (and `tick()`
per window); the agent's lanes ask `POLICY.threads()` for an op that computes alone
(edgeprobe_agent.threads.Cores), while overlapping lanes keep one core each.

Inside a host pass BLAS runs one thread a call, and the host's GEMMs (`matmul_wt`) and row splits spread fixed
blocks over a pool whose threads block rather than spin, on every core: beside a busy core each still adds its fair
share of time; each thread takes the next block as it comes free. The blocks depend on the shapes alone, so a pass's
bits do not depend on the count or the load. A profile's statistics of an activation run `beside` the pass on a pool
thread (over the next GEMM's blocks), done by the pass's exit (`settle`).
EDGEPROBE_THREADS=N fixes the count at N (no measuring); unset or `auto`, it is measured. EDGEPROBE_ROW_SPLITS=0 runs
the row-wise ops outside the GEMMs (norms, RoPE, residual adds, the profiles' statistics) whole on the calling thread,
as before they ran in row blocks over the pool (a bench knob: the bits are the same either way).
A window-major pass that starts with two or more threads computes its windows side by side, one a thread, and
commits them in window order (side_by_side); EDGEPROBE_SIDE_BY_SIDE=0 runs them in turn, their GEMMs' blocks spread
(a bench knob too: the same bits).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import math
import os
import sys
import threading
import time

import numpy as np

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
BUSY_SHARE = 0.4      # a core that other processes use more than this share of the time is theirs
INTERVAL_S = 0.25     # the shortest interval a measurement averages over (/proc/stat counts in 10 ms ticks)
FIRST_S = 0.08        # a pass starts after a measurement this long (its own: the load may have changed since)
STALE_S = 1.0         # a pass starting longer than this after the last sample measures anew: the average since
                      # then would still count a neighbour that has gone (or miss one that came)
# row-wise ops outside the GEMMs split their rows over a pass's threads (ROW_SPLITS = False: bench/threads.py's A/B)
ROW_SPLITS = os.environ.get("EDGEPROBE_ROW_SPLITS", "1").strip() != "0"
# a window-major pass computes its windows side by side (side_by_side; False: in turn, bench/threads.py's A/B)
SIDE_BY_SIDE = os.environ.get("EDGEPROBE_SIDE_BY_SIDE", "1").strip() != "0"


def threads_for(cores: int, others: float) -> int:
    """The decision: threads for work that may use `cores` while other processes keep `others` cores busy
    (averaged, 0..cores). Each core counted busy costs a thread; never fewer than one."""
    taken = math.floor(max(0.0, others) + 1.0 - BUSY_SHARE)
    return max(1, min(cores, cores - taken))


@functools.cache
def _openblas():
    """(set_num_threads, get_num_threads) of numpy's bundled OpenBLAS (process-wide), or None (another BLAS: left
    as started). Looked up once per process."""
    try:
        import numpy as np

        libs = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "lib*openblas*"))
        for path in libs:
            lib = ctypes.CDLL(path)
            for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
                setter, getter = f"{prefix}_set_num_threads{suffix}", f"{prefix}_get_num_threads{suffix}"
                if hasattr(lib, setter) and hasattr(lib, getter):
                    get = getattr(lib, getter)
                    get.restype = ctypes.c_int
                    return getattr(lib, setter), get
    except OSError:
        pass
    return None


class CpuLoad:
    """Cores other processes kept busy between two samples: busy jiffies (user, nice, system, irq, softirq,
    steal) of this process's CPUs in /proc/stat, minus this process's own CPU time (every thread, spinning BLAS
    workers included). Without a readable /proc/stat (macOS; an Android app) it reports 0: a quiet machine."""

    def __init__(self, cpus=None, stat_path: str = "/proc/stat"):
        self.cpus = {f"cpu{c}" for c in (cpus if cpus is not None else
                                         os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ())}
        self.path = stat_path
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def sample(self) -> tuple[float, float, float] | None:
        """(monotonic s, busy CPU-seconds of our CPUs since boot, this process's CPU-seconds), or None."""
        try:
            with open(self.path, "rb") as f:
                text = f.read().decode()
        except OSError:
            return None
        busy = 0
        for line in text.splitlines():
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if name in self.cpus:
                v = [int(x) for x in fields[:8]] + [0] * (8 - len(fields[:8]))
                busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
        return time.monotonic(), busy * self.tick_s, time.process_time()

    def between(self, a, b) -> float:
        """Other processes' busy cores from sample a to sample b, clipped to 0..len(cpus)."""
        dt = b[0] - a[0]
        if dt <= 0:
            return 0.0
        return min(float(len(self.cpus)), max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / dt))


class ThreadPolicy:
    """Threads = the cores not busy with other processes (threads_for), measured by `load` at most every
    INTERVAL_S. load: a CpuLoad, a callable returning others' busy cores (tests inject one), or None (assume a
    quiet machine: all cores). fixed: a count that overrides the measurement; None takes EDGEPROBE_THREADS's
    when `env` (the user's word: a count, or `auto`, the default), else measures.

    The count changes a host pass's speed, never its bits: inside a pass BLAS runs one thread a call and the GEMMs
    are cut into blocks that depend on their shapes alone (matmul_wt). OpenBLAS's own threading rounds float32
    GEMMs differently with one thread than with two, which made a calibration, and the model quantized from it,
    depend on the load (SmolLM2's smoothquant perplexity over 64 tokens: 1.62x float's at two threads, 1.49x at
    one)."""

    def __init__(self, cores: int = CORES, load=None, fixed: int | None = None, env: bool = True):
        self.cores, self.load = cores, load
        word = os.environ.get("EDGEPROBE_THREADS", "") if env else ""
        self.fixed = fixed if fixed is not None else (int(word) if word.isdigit() and int(word) > 0 else None)
        self.last = None            # the count of the last decision (the bench prints it)
        self.chosen: dict = {}      # count -> decisions made with it
        self.width = 1              # threads the pool spreads blocks over: every core (or fixed) in a host pass, else 1
        self._others = 0.0
        self._sample = None         # the open window's first sample, or None (none open: the next op opens one)
        self._spent = (0.0, 0.0)    # (others' busy CPU-seconds, seconds) of the agent's closed windows (pause())
        self._measuring = threading.Lock()
        self._lock = threading.Lock()  # the host passes' depth and BLAS's saved count
        self._blas = _openblas()  # set / get, resolved once
        self._depth = 0             # host passes running in this process (BLAS's count is process-wide)
        self._blas_before = None

    def others(self, fresh: bool = False) -> float:
        """Cores other processes keep busy: the last measurement, renewed once INTERVAL_S have passed. fresh: a
        pass starts, so the interval since the last sample counts once FIRST_S long; the process's first pass
        measures FIRST_S itself (this process idle meanwhile), as does a pass STALE_S or more after the last sample."""
        load = self.load
        if load is None:
            return 0.0
        if not isinstance(load, CpuLoad):
            return float(load())
        s, now = self._sample, time.monotonic()
        if s is not None and now - s[0] + self._spent[1] < (FIRST_S if fresh else INTERVAL_S):
            return self._others
        if not self._measuring.acquire(blocking=False):
            return self._others  # another lane is measuring: its result serves this op too
        try:
            s = self._sample
            if s is None or (fresh and time.monotonic() - s[0] > STALE_S):
                s = self._sample = load.sample()
                if fresh:  # a pass measures FIRST_S of its own: nothing the agent's runs carried
                    self._spent = (0.0, 0.0)
                if s is None or not fresh:
                    return self._others  # no /proc/stat, or a lane's first op: the next one has an interval
                time.sleep(FIRST_S)
            b = load.sample()
            if b is not None:
                busy, dt = self._spend(s, b)
                self._others, self._sample, self._spent = (busy / dt if dt > 0 else 0.0), b, (0.0, 0.0)
            return self._others
        finally:
            self._measuring.release()

    def pause(self) -> None:
        """The agent stops computing (its last run ended): the open window closes and its time joins the next
        measurement, and the time until resume() counts for none. What other processes do while the agent is idle is
        not the load its next run meets: counted, llama.cpp's prefill right before the agent's would put both cores
        busy and the agent's next two 256-token prefills' GEMMs on one thread, 30-45% slower (docs/benchmarks.md).
        A neighbour running beside the agent's runs is still seen, over their time summed."""
        if not isinstance(self.load, CpuLoad):
            return
        with self._measuring:
            s, b = self._sample, self.load.sample()
            if s is not None and b is not None:
                self._spent = self._spend(s, b)
            self._sample = None

    def _spend(self, s, b) -> tuple[float, float]:
        """(others' busy CPU-seconds, seconds) of the closed windows and the window from sample s to b."""
        busy, dt = self._spent
        d = max(0.0, b[0] - s[0])
        return busy + self.load.between(s, b) * d, dt + d

    def resume(self) -> None:
        """The agent computes again (a run starts after none ran): a window opens now; until the windows since the
        last measurement span INTERVAL_S its ops keep the count measured last (all cores before any)."""
        if not isinstance(self.load, CpuLoad):
            return
        with self._measuring:
            if self._sample is None:
                self._sample = self.load.sample()

    def threads(self, cap: int | None = None, fresh: bool = False) -> int:
        """The thread count for work that may use `cap` cores (default all of this process's)."""
        cores = min(cap or self.cores, self.cores) if self.fixed is None else min(cap or self.fixed, self.fixed)
        k = cores if self.fixed is not None else threads_for(cores, self.others(fresh))
        self.last = k
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def tick(self, fresh: bool = False) -> int | None:
        """Inside host_pass: decide again (cheap: a measurement at most every INTERVAL_S) and set this thread's numba
        count to it (its teams spin while they wait); the pool (matmul_wt, splits) takes every core, or the fixed
        count. Call it per window or layer. Returns the count; outside a pass it sets nothing (nothing would set it
        back) and returns None."""
        if not self._depth:
            return None
        k = self.threads(fresh=fresh)
        # the pool's threads block, never spin: beside a busy core every core still adds its fair share of time
        # (bench/threads.py: two threads beside a hog or a 2-thread BLAS job kept 0.8-1.0x, one thread 0.6-0.85x)
        self.width = self.fixed or self.cores
        numba = sys.modules.get("numba")  # not imported for it: a pass that runs no numba kernel pays nothing
        if numba is not None:
            # a thread computing one window beside others (side_by_side) keeps to itself
            n = 1 if getattr(_WORKER, "busy", False) else min(k, numba.config.NUMBA_NUM_THREADS)
            if numba.get_num_threads() != n:
                numba.set_num_threads(n)  # per calling thread
        return k

    @contextlib.contextmanager
    def host_pass(self):
        """A host pass's threads: BLAS at one thread a call, the count measured at entry and renewed by tick();
        BLAS's and this thread's numba counts set back at exit. Nested passes share the outermost one's."""
        with self._lock:
            self._depth += 1
            outer = self._depth == 1
            if outer and self._blas is not None:
                self._blas_before = int(self._blas[1]())
                if self._blas_before != 1:
                    self._blas[0](1)  # process-wide: a BLAS call already running keeps the threads it started with
        numba = sys.modules.get("numba")
        numba_before = numba.get_num_threads() if numba is not None else None
        try:
            self.tick(fresh=outer)  # a nested pass (a plan inside a decode loop) takes the outer one's recent decision
            try:
                yield self
            except BaseException:
                settle(raising=False)  # the pass's own error wins; nothing is left running
                raise
            settle()  # what ran beside the pass is done before its results are read
        finally:
            if numba_before is not None:
                numba.set_num_threads(numba_before)
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self.width = 1
                    if self._blas is not None and self._blas_before != 1:
                        self._blas[0](self._blas_before)
            if outer and self.fixed is None:
                # the load over the pass's last stretch, sampled now: a pass right after it starts from that, where
                # a sample older than STALE_S (a 512-token window's tick, ~1.5 s) cost it FIRST_S of sleep
                self.others()


POLICY = ThreadPolicy(load=CpuLoad())


def host_pass():
    """`with host_pass() as p:` around a host pass (p.tick() per window), or `@host_pass()` on a pass's function:
    the process's one POLICY."""
    return POLICY.host_pass()


def tick() -> int | None:
    """POLICY.tick(): inside a host pass, decide again per window or layer."""
    return POLICY.tick()


# A host GEMM's output columns are cut into blocks that depend on its width alone, and each block is one BLAS call
# on one BLAS thread: the bits are the same whatever the number of threads running the blocks (OpenBLAS's own
# threading splits the rows, and its sums there change with the row count).
BLOCK_COLS = 128      # about this many output columns a block
MAX_BLOCKS = 16       # at most this many blocks (an LM head's 49,152 columns: 16 blocks of 3,072)
MIN_COLS = 64         # a prompt's GEMM of 128-255 columns (SmolLM2's K and V: 192) still gets two blocks of this many+
_ALIGN = 16           # block edges on multiples of 16 columns: whole micro-kernel tiles


@functools.lru_cache(maxsize=1024)
def column_blocks(n: int, least: int = 1) -> tuple[tuple[int, int], ...]:
    """The fixed (start, stop) column blocks of an n-column GEMM output: a function of n (and least) alone. least:
    at least this many blocks where each keeps MIN_COLS columns (matmul_wt's prompt rows: 2, so that a K or V
    projection of 192 columns is not one block on one core, ~4% of a pass's CPU time)."""
    nb = max(1, min(MAX_BLOCKS, max(n // BLOCK_COLS, min(least, n // MIN_COLS))))
    edges = sorted({0, n, *(min(n, round(n * i / nb / _ALIGN) * _ALIGN) for i in range(1, nb))})
    return tuple(zip(edges[:-1], edges[1:]))


_POOL = None
_POOL_LOCK = threading.Lock()
_WORKER = threading.local()  # .busy in the pool's own threads


def _mark_worker():
    _WORKER.busy = True


def _forget_pool():
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):  # a forked child has none of the pool's threads: it makes its own
    os.register_at_fork(after_in_child=_forget_pool)


def _pool():
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor
            _POOL = ThreadPoolExecutor(max_workers=max(1, CORES - 1), thread_name_prefix="edgeprobe-gemm",
                                       initializer=_mark_worker)
        return _POOL


def spread(fn, parts: list) -> None:
    """fn(part) for every part: the calling thread runs the first, the pool's threads the others (numpy's ufuncs and
    BLAS release the GIL); returns once all are done, raising the first part's error. Called from one of the pool's
    threads (a weight read inside a spread block), it runs every part there: waiting on the pool from inside it could
    leave no thread to run what it waits for."""
    if len(parts) < 2 or getattr(_WORKER, "busy", False):
        for part in parts:
            fn(part)
        return
    futures = [_pool().submit(fn, part) for part in parts[1:]]
    try:
        fn(parts[0])
    finally:
        for f in futures:
            f.result()


_PENDING = threading.local()  # .future: the calling thread's task running beside it (beside), or None


def beside(fn) -> None:
    """fn() on one of the pool's threads while the calling thread goes on, inside a host pass on two or more
    threads; else fn() now. For observers (a profile's statistics of an activation): the next op's GEMM blocks run
    meanwhile and the pool's thread joins them once fn is done, where the statistics alone, split in blocks of
    ~0.5 ms, scaled poorly (waking the pool's thread costs ~0.1 ms). fn must not write what the pass computes and
    nothing may write what fn reads until it is done. One at a time per calling thread (a second waits for the
    first): settle(), called at every host pass's exit, waits for it and raises its error."""
    settle()
    if POLICY._depth and POLICY.width > 1 and ROW_SPLITS and not getattr(_WORKER, "busy", False):
        _PENDING.future = _pool().submit(fn)
    else:
        fn()


def settle(raising: bool = True) -> None:
    """Wait for the calling thread's task running beside it (beside); raise its error (raising)."""
    f = getattr(_PENDING, "future", None)
    if f is None:
        return
    _PENDING.future = None
    try:
        f.result()
    except BaseException:
        if raising:
            raise


def run_blocks(fn, blocks) -> None:
    """fn(start, stop) for every block, spread over the current host pass's threads (POLICY.width): each thread takes
    the next block not yet taken, so a thread slowed by a neighbour process or by waiting for the GIL takes fewer
    (with contiguous shares the pass waited for its slowest share). The blocks must write disjoint outputs; which
    thread runs a block never changes a bit."""
    blocks = list(blocks)
    k = min(POLICY.width, len(blocks))
    if k < 2:
        for a, b in blocks:
            fn(a, b)
        return
    taken = iter(blocks)
    lock = threading.Lock()

    def run(_):
        while True:
            with lock:
                block = next(taken, None)
            if block is None:
                return
            fn(*block)

    spread(run, [None] * k)


def side_by_side(n: int, compute, commit, most: int | None = None) -> None:
    """commit(i, compute(i)) for i in range(n), the commits in order of i, with up to POLICY.width (and `most`)
    computes at once inside a host pass: a window-major pass's windows side by side, one thread each.

    A compute running beside another runs alone on its thread: its GEMMs and row splits are not spread (the same
    blocks, so the same bits). Two windows at once kept both cores busy where one window's GEMMs, spread in column
    blocks, waited at every join (the passes' GEMMs: 1.93-1.97x on two threads against 1.80x, interleaved in one
    run). A compute that finds no other running (the last window) spreads its blocks as before. A thread whose
    result is not yet due leaves it and computes the next window; the thread that commits i commits every later
    result already there, each alone on its thread (a profile's statistics: in window order, as one thread would run
    them). At most `k` results wait at once (k: the computes at once), so at most 2k are held. The first error stops
    the taking of windows and is raised here."""
    k = min(POLICY.width, n, most or n) if POLICY._depth and SIDE_BY_SIDE else 1
    if k < 2 or getattr(_WORKER, "busy", False):
        for i in range(n):
            commit(i, compute(i))
        return
    cv = threading.Condition()
    st = {"next": 0, "turn": 0, "computing": 0, "committing": False, "failed": False}
    due: dict = {}  # i -> compute(i)'s result, waiting for commit(i - 1)

    def commit_due():  # commits while the next result due is there; the caller holds the committing role
        while True:
            with cv:
                i = st["turn"]
                if i not in due or st["failed"]:
                    st["committing"] = False
                    cv.notify_all()
                    return
                r = due.pop(i)
            commit(i, r)
            with cv:
                st["turn"] += 1
                cv.notify_all()

    def run(_):
        was = getattr(_WORKER, "busy", False)
        try:
            while True:
                with cv:
                    # bounded memory: wait for the commits to catch up, but never with nothing left to take (the
                    # last window's spread may wait for this thread to leave)
                    while len(due) >= k and st["next"] < n and not st["failed"]:
                        cv.wait()
                    i = st["next"]
                    if st["failed"] or i >= n:
                        return
                    st["next"] += 1
                    alone = i + 1 < n or st["computing"] > 0  # the last window with no other running: spread
                    st["computing"] += 1
                _WORKER.busy = alone or was
                try:
                    r = compute(i)
                finally:
                    _WORKER.busy = True  # commits run alone on this thread
                    with cv:
                        st["computing"] -= 1
                with cv:
                    due[i] = r
                    mine = not st["committing"] and st["turn"] == i
                    if mine:
                        st["committing"] = True
                if mine:
                    commit_due()
        except BaseException:
            with cv:
                st["failed"] = True
                cv.notify_all()
            raise
        finally:
            _WORKER.busy = was

    spread(run, [None] * k)


SMALL_M = 32  # up to this many rows a block is (w x^T)^T: OpenBLAS's small-M GEMM is 2-5x slower on them


def matmul_wt(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x @ w^T for x float32[M, K], w float[N, K] -> float32[M, N]: each of column_blocks(N, 2) one BLAS call,
    spread over the host pass's threads (run_blocks). Inside a host pass BLAS runs one thread a call, so the bits do
    not depend on the thread count; for few rows (decode) each of column_blocks(N) is (w_block @ x^T)^T
    (bench/decode.py)."""
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.result_type(x, w))
    if isinstance(w, np.memmap):  # a block's slice of a memmap runs Python (__array_finalize__) under the GIL
        w = w.view(np.ndarray)
    if x.shape[0] <= SMALL_M:  # a decode step's GEMM is too short to pay for a second block
        def block(a, b):
            y[:, a:b] = (w[a:b] @ x.T).T
    else:
        def block(a, b):  # BLAS writes y's columns in place (their row stride is y's): no [M, b - a] temporary
            np.matmul(x, w[a:b].T, out=y[:, a:b])
    run_blocks(block, column_blocks(w.shape[0], 1 if x.shape[0] <= SMALL_M else 2))
    return y
