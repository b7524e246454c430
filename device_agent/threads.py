"""How many cores an op's kernels may use: what the one thread policy gives while no other lane is computing, else one.

A lane stands for one processor, so lanes that overlap get a core each (the agent starts BLAS and numba with one
thread). But a lane computing alone — a decode step, or the NPU's GEMMs between the CPU's norms in a
layer-by-layer prefill — would leave the other core idle, which llama.cpp on the same cores does not: there the
op's BLAS and numba kernels use the cores that other processes leave free (edgeprobe_kernels.threads, the policy
host passes use too: all cores on a quiet machine, one beside a CPU-bound process). Each trace event records the
threads its op had.
"""
from __future__ import annotations

import contextlib
import threading

from edgeprobe_kernels.threads import CORES, POLICY, ThreadPolicy, _openblas


class Cores:
    """Counts the lanes computing right now (every run's, one lock) and sets each op's thread counts."""

    def __init__(self, cores: int = CORES):
        self.cores, self.enabled = cores, False
        # until enable(): a policy that measures nothing (all cores to an op alone); enable() takes the process's POLICY
        self.policy = ThreadPolicy(cores, load=None, env=False)
        self._busy = 0
        self._runs = 0  # runs under running(): the load is measured while one is
        self._blas = 1
        self._lock = threading.Lock()
        self._set_blas = self._set_numba = None
        self._numba_n = threading.local()  # the count last set on each thread (numba's is per thread)

    def enable(self) -> None:
        """In the agent process (which starts BLAS with one thread): give lone ops the cores the policy finds free
        from now on. Not in a host process running plans in-process: its passes set threads by host_pass."""
        if self.cores < 2:
            return
        self.policy = POLICY
        blas = _openblas()  # numpy's OpenBLAS's (set, get), process-wide; None: another BLAS, left as started
        self._set_blas = blas[0] if blas is not None else None
        try:
            import numba

            self._set_numba = numba.set_num_threads if numba.config.NUMBA_NUM_THREADS > 1 else None
        except ImportError:
            self._set_numba = None
        self.enabled = True
        if self._set_blas is not None:
            from edgeprobe_kernels import llama_ops

            llama_ops.SPLIT_HOOK = self.single_blas  # an op alone may split its rows over the cores (attention, SwiGLU)

    @contextlib.contextmanager
    def single_blas(self):
        """BLAS on one thread while an op runs its own parts on every core (llama_ops._split); then as before."""
        with self._lock:
            if self._blas != 1:
                self._set_blas(1)
        try:
            yield
        finally:
            with self._lock:
                if self._blas != 1:  # what enter() last set (an op starting meanwhile on another lane sets 1)
                    self._set_blas(self._blas)

    @contextlib.contextmanager
    def running(self):
        """Around a run (a request's passes): the policy measures other processes' load over the time runs compute
        only (ThreadPolicy.pause / resume), not while the agent waits for the next request."""
        if not self.enabled:
            yield
            return
        with self._lock:
            self._runs += 1
            if self._runs == 1:
                self.policy.resume()
        try:
            yield
        finally:
            with self._lock:
                self._runs -= 1
                if self._runs == 0:
                    self.policy.pause()

    def lanes_started(self) -> None:
        """A lane thread of a run with two or more lanes starts: give it an OpenMP team now (a tiny parallel loop
        on every core). libgomp spins ~3 ms after each parallel region while its pool threads are no more than the
        cores, and otherwise sleeps at once: the lone team of a decode step's thread spins across the gaps between
        its kernels, but one lane's spinning worker takes the core the other lane computes on (q4_0-tile decode,
        npu GEMMs between cpu ops: 100 -> 230 ms a step). A team on every lane thread puts the count past the
        cores for the run's duration; the teams end with their threads."""
        if self.enabled and self._set_numba is not None:
            from edgeprobe_kernels.warm import build_team

            build_team(self.cores)
            self._numba_n.k = None  # build_team sets this thread's count itself

    def enter(self, side: bool = False) -> int | None:
        """An op starts on the calling lane thread: its thread count (all cores if it computes alone); None
        when not enabled (the kernels keep the process's settings). A side op (ops.runs_beside) gets one thread
        and leaves the count of computing lanes as it was: an int8 GEMM that starts while its shadow delta runs
        still gets every core (it took one, 940 us against 220 for a 64-row q/k/v/o GEMM), and the two share a
        core for the delta's ~1/10 of the GEMM's time."""
        if not self.enabled:
            return None
        if side:
            k = 1
        else:
            with self._lock:
                self._busy += 1
                k = self.policy.threads(self.cores) if self._busy == 1 else 1
                if self._set_blas is not None and k != self._blas:
                    self._set_blas(k)  # process-wide: an op already running keeps the threads it started with
                    self._blas = k
        if self._set_numba is not None and getattr(self._numba_n, "k", None) != k:
            self._set_numba(k)  # numba's count is per calling thread; setting it costs ~5 us an op, most ops keep it
            self._numba_n.k = k
        return k

    def leave(self, side: bool = False) -> None:
        if not self.enabled or side:
            return
        with self._lock:
            self._busy -= 1


CORES_IN_USE = Cores()
