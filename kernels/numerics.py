"""Per-op output summaries for the numerics capture (issue 41): the same code on the host and on the agent.

A summary of an op's output x (any numeric dtype, any shape) is a msgpack-able map:
    shape, dtype, size, l2 (float64 sqrt of the sum of squares of the finite values), max_abs, mean (finite values),
    nonfinite (NaN and +-inf count), zeros, hist: 64 counts of floor(log2|x|) over the finite non-zero values, bin b
    holding exponents HIST_LO + b (values below HIST_LO, subnormals among them, in bin 0; above, in bin 63).
The exponent comes from float32's bit pattern (no log), so the histogram is exact and costs one integer pass.
`Capture` is what the agent's executor calls after each op whose name it wants (edgeprobe_agent.executor), and a
fused op after each of its sub-ops (edgeprobe_agent.ops.fused: a decode step's ops are sub-ops of its step op).
"""
from __future__ import annotations

import fnmatch
import threading

import numpy as np

HIST_BINS = 64
HIST_LO = -32                       # bin 0: floor(log2|x|) <= -32; bin 63: >= 31
MAX_FULL_BYTES = 256 << 20          # full tensors one run may send back unless the request sets full_limit_bytes
# what an agent's capture knows (hello's "numerics", the reply's numerics "version"; an agent without either is 1):
# 1 the plan's own ops; 2 also the sub-ops of fused ops (a decode step) and each step of a decode loop apart
CAPTURE_VERSION = 2


try:  # one serial pass per tensor where numba is (the local agent, the host); numpy's passes elsewhere (arm64)
    import numba
except ImportError:
    numba = None


def _moments_numpy(f: np.ndarray) -> tuple:
    """f float32[n] -> (counts int64[256] of the biased exponent, sum x^2, sum x, max |x|, zeros), finite x only
    in the sums (no BLAS: its threads crawl on a loaded phone's cores)."""
    counts = np.bincount((f.view(np.uint32) >> np.uint32(23)).astype(np.uint8), minlength=256)
    if counts[255]:
        f = f[np.isfinite(f)]
    if not f.size:
        return counts, 0.0, 0.0, 0.0, 0
    return (counts, float(np.einsum("i,i->", f, f, dtype=np.float64)), float(f.sum(dtype=np.float64)),
            float(max(f.max(), -f.min())), int(np.count_nonzero(f == 0)) if counts[0] else 0)


def _summary_numpy(f: np.ndarray) -> tuple:
    """f float32[n] -> (hist int64[HIST_BINS], nonfinite, sum x^2, sum x, max |x|, zeros) from the exponent counts."""
    counts, ss, sm, mx, zeros = _moments_numpy(f)
    lo = 127 + HIST_LO  # the biased exponent of bin 0
    hist = counts[lo:lo + HIST_BINS].astype(np.int64)
    hist[0] += counts[:lo].sum() - zeros  # below the bins: subnormals and tiny values
    hist[-1] += counts[lo + HIST_BINS:255].sum()
    return hist, int(counts[255]), ss, sm, mx, zeros


if numba is not None:
    @numba.njit(nogil=True, cache=True)
    def _summary_numba(f):
        # the bins in the one pass: a decode step's outputs are ~600 values, where numpy's passes over the exponent
        # counts cost more than the pass itself
        hist = np.zeros(HIST_BINS, np.int64)
        bits = f.view(np.uint32)
        ss, sm, mx, zeros, nonfinite = 0.0, 0.0, 0.0, 0, 0
        for i in range(f.size):
            e = np.int64((bits[i] >> 23) & 0xFF)
            if e == 255:
                nonfinite += 1
                continue
            v = np.float64(f[i])
            ss += v * v
            sm += v
            a = abs(v)
            if a > mx:
                mx = a
            if e == 0 and v == 0.0:
                zeros += 1
                continue
            b = min(max(e - 127 - HIST_LO, 0), HIST_BINS - 1)
            hist[b] += 1
        return hist, nonfinite, ss, sm, mx, zeros
else:
    _summary_numba = None


def summarize(x, use_numba: bool = True) -> dict:
    """The summary of one array (see the module doc): float64 sums, an exact histogram from float32 exponent bits."""
    a = np.asarray(x)
    out = {"shape": list(a.shape), "dtype": a.dtype.name, "size": int(a.size)}
    f = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    pass_ = _summary_numba if use_numba and _summary_numba is not None else _summary_numpy
    hist, nonfinite, ss, sm, mx, zeros = pass_(f)
    n = f.size - nonfinite
    out.update(l2=float(np.sqrt(ss)), max_abs=float(mx), mean=float(sm / n) if n else 0.0, nonfinite=int(nonfinite),
               zeros=int(zeros), hist=hist.tolist())
    return out


def select(names, pattern) -> list:
    """The names a pattern picks, in their order: None picks all; else comma-separated shell globs ("blk.1.*")."""
    if pattern is None:
        return list(names)
    pats = [p.strip() for p in str(pattern).split(",") if p.strip()]
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)]


class CaptureError(ValueError):
    """A capture that cannot be done: code is an agent error code ("bad_request", "memory_budget")."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Capture:
    """One run's numerics capture: `ops` the names to summarize, `full` those whose whole output is kept too.
    take(name, out) -> out (changed only by the test-only fault), called by the executor from any lane's thread.
    fault (TEST ONLY, request field numerics.fault = {"op", "index", "codes", "step"}): adds codes * max|x| / 127 (one
    int8 code at a per-tensor scale) to element `index` of that op's output, which then flows on to later ops; with
    "step", only in that step of a decode loop. `step`: the decode loop's step now running (the server sets it;
    None outside a loop), kept in each summary and full tensor taken."""

    def __init__(self, names, pattern=None, full=(), limit_bytes: int = MAX_FULL_BYTES, fault: dict | None = None):
        self.ops = frozenset(select(names, pattern))
        if not self.ops:
            raise CaptureError("bad_request", f"numerics ops pattern {pattern!r} names no op of the plan")
        missing = [n for n in full if n not in set(names)]
        if missing:
            raise CaptureError("bad_request", f"numerics full names {missing[:3]} which are not ops of the plan")
        self.full = frozenset(full)
        self.ops |= self.full
        if fault and fault.get("op") not in self.ops:  # a fault that would never land reads as a clean run
            where = "is not an op of the plan" if fault.get("op") not in set(names) else "is not among the ops captured"
            raise CaptureError("bad_request", f"numerics fault op {str(fault.get('op'))[:60]!r} {where}")
        self.limit = int(limit_bytes)
        self.fault = fault or None
        self.summaries: list = []
        self.tensors: list = []   # (name, array) of full captures, in capture order
        self.full_bytes = 0
        self.step: int | None = None
        self._lock = threading.Lock()

    @classmethod
    def of_request(cls, field, names) -> "Capture | None":
        """A run request's `numerics` field {"ops": pattern | None, "full": [names], "full_limit_bytes": int,
        "fault": {...} (test only)} over the plan's op names -> its Capture (None: no field, no capture)."""
        if field is None:
            return None
        if not isinstance(field, dict):
            raise CaptureError("bad_request", "numerics must be a map {'ops': pattern or null, 'full': [op names]}")
        pattern, full = field.get("ops"), field.get("full") or []
        limit, fault = field.get("full_limit_bytes", MAX_FULL_BYTES), field.get("fault")
        if pattern is not None and not isinstance(pattern, str) or not isinstance(full, list) \
                or not all(isinstance(n, str) for n in full) or not isinstance(limit, int) \
                or fault is not None and not (isinstance(fault, dict) and isinstance(fault.get("op"), str)):
            raise CaptureError("bad_request", "numerics: 'ops' is a glob pattern or null, 'full' a list of op names, "
                                              "'full_limit_bytes' an integer, 'fault' (test only) a map with 'op'")
        return cls(names, pattern, full, limit, fault)

    def take(self, name: str, out):
        if self.fault is not None and self.fault.get("op") == name and self.fault.get("step", self.step) == self.step:
            # order="C": a kernel's transposed result (numpy's GEMMs on arm64) copied as is would make reshape a
            # copy, and the fault would land in it instead of in the output
            out = np.array(out, dtype=np.float32, order="C", copy=True)
            flat = out.reshape(-1)
            amax = float(np.abs(flat).max()) if flat.size else 0.0
            flat[int(self.fault.get("index", 0)) % max(flat.size, 1)] += float(self.fault.get("codes", 1)) * amax / 127
        s = summarize(out)
        s["op"] = name
        if self.step is not None:
            s["step"] = self.step
        kept = None
        if name in self.full:
            kept = np.array(out, copy=True)  # kernels may reuse their buffers (arena) after the op
        with self._lock:
            if kept is not None:
                if self.full_bytes + kept.nbytes > self.limit:
                    raise CaptureError("memory_budget", f"full capture of {name!r} would bring the run's full tensors "
                                                        f"to {self.full_bytes + kept.nbytes} bytes, over the limit of "
                                                        f"{self.limit} bytes; capture fewer ops in full or raise "
                                                        "full_limit_bytes")
                self.full_bytes += kept.nbytes
                self.tensors.append((name, kept, self.step))
            self.summaries.append(s)
        return out

    def reply(self) -> tuple[dict, list]:
        """(the reply's numerics map, the full tensors as frames in the order its "full" lists them; a decode loop's
        "full_steps" gives each one's step, as its summaries' "step" do)."""
        out = {"version": CAPTURE_VERSION, "summaries": self.summaries, "full": [n for n, _, _ in self.tensors],
               "full_bytes": self.full_bytes}
        if any(s is not None for _, _, s in self.tensors):
            out["full_steps"] = [s for _, _, s in self.tensors]
        return out, [a for _, a, _ in self.tensors]
