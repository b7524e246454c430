"""The npu lane's "DSP": the HVX kernels of kernels/hvx/ as real Hexagon code, run under qemu-hexagon.

FastRPC's shape, without a phone: one long-lived Hexagon process per agent (`qemu-hexagon` running the
freestanding program hvx_build makes from kernels/hvx/), tensors in one shared arena (a memfd both sides map, as
FastRPC shares ION / dmabuf buffers), and one 80-byte message struct each way over the process's stdin and
stdout (kernels/hvx/hvx_msg.h). Weights are packed into the layout vrmpy reads once and stay in the arena (keyed by
the caller).

Every call reports QEMU's own counts of the packets, instructions and HVX instructions the op executed
(kernels/hvx/hvx_runtime.c) and a labelled estimate of the cycles a v73 cDSP would need (`dsp_estimate`).
The results are real (the machine code computed them); the host's wall time under QEMU is not a DSP's time.
"""
from __future__ import annotations

import atexit
import hashlib
import mmap
import os
import select
import struct
import subprocess
import threading
from pathlib import Path

import numpy as np

from . import hvx_build
from .hvx_build import (
    CFLAGS,
    CLANG,
    INSTALL_HINT,
    ISA,
    LLD,
    QEMU,
    SOURCE_DIR,
    HvxError,
    HvxUnavailable,
    available,
    cache_dir,
    toolchain,
    unavailable_reason,
)

__all__ = ["CFLAGS", "CLANG", "INSTALL_HINT", "ISA", "LLD", "QEMU", "SOURCE_DIR", "HvxDsp", "HvxError",
           "HvxUnavailable", "available", "build", "cache_dir", "dsp_estimate", "pack_weight", "shared", "toolchain",
           "unavailable_reason"]

# kernels/hvx/hvx_msg.h, mirrored: keep the two in step (a PING checks the struct size at start)
MSG = struct.Struct("<20I")
MAGIC, VERSION = 0x31585648, 1
(OP_INIT, OP_PING, OP_QUANTIZE, OP_GEMM_S8S32, OP_W8A8, OP_Q4_TILE_DEQUANT, OP_EXP_LUT, OP_EXIT,
 OP_GEMM_F16W) = range(1, 10)
FLAG_SMOOTH = 1
STATUS = {0: "ok", 1: "bad magic", 2: "unknown op", 3: "buffer outside the arena", 4: "shape not allowed",
          5: "vector buffer not 128-byte aligned", 6: "arena not mapped", 7: "arena mmap failed"}
VEC = 128
MAX_K = 8192   # HVX_MAX_K: per-channel divisors the program keeps
OVERREAD = 512  # HVX_OVERREAD: inputs read in whole vectors need this much arena after them
SB_BYTES = 144  # kernels/tiles.py super-block

# The cycle estimate: one packet per cycle on one hardware thread with its data in VTCM/L2 (no stalls), at a
# clock Qualcomm does not publish for the v73 cDSP; 1 GHz is an assumption, not a measurement.
DSP_CLOCK_HZ = 1.0e9
DSP_MODEL = "hexagon-v73-cdsp (estimate: 1 packet/cycle, one HVX thread, no memory stalls, 1 GHz assumed)"


def build(out_dir: Path | None = None) -> Path:
    """hvx_build.build of this module's SOURCE_DIR, which callers may point at another copy of the sources."""
    return hvx_build.build(out_dir, SOURCE_DIR)


def dsp_estimate(counts: dict) -> dict:
    """QEMU's packet count of one call -> the trace fields of what it would cost on a v73 cDSP (an estimate)."""
    p = int(counts["packets"])
    return {"hvx_packets": p, "hvx_insns": int(counts["hvx_insns"]), "scalar_packets": int(counts["scalar_packets"]),
            "dsp_cycles_estimate": p, "dsp_us_estimate": p / DSP_CLOCK_HZ * 1e6, "dsp_clock_hz": DSP_CLOCK_HZ,
            "dsp_model": DSP_MODEL}


def pack_weight(bt: np.ndarray) -> np.ndarray:
    """int8[K, N] (k-major, as run_w8a8 stores it) -> uint8[Kp/4, Np, 4]: groups of 4 inputs per output column,
    the layout vrmpy reads (32 columns x 4 inputs per vector); K padded to 4 and N to 32 with zeros."""
    K, N = bt.shape
    Kp, Np = -(-K // 4) * 4, -(-N // 32) * 32
    b = np.zeros((Kp, Np), np.int8)
    b[:K, :N] = bt
    return np.ascontiguousarray(b.reshape(Kp // 4, 4, Np).transpose(0, 2, 1)).view(np.uint8)


def _f32_bits(v) -> int:
    return int(np.float32(v).view(np.uint32))


def _align(n: int, a: int = VEC) -> int:
    return -(-n // a) * a


class HvxDsp:
    """One Hexagon process and its arena. Thread-safe: every call holds the lock from marshalling to reply.

    Arena layout: [0, scratch_bytes) per-call buffers (inputs, outputs, scratch), then weights, packed once and
    kept by key until the arena is full (then all are dropped and re-packed on use)."""

    def __init__(self, arena_mb: int | None = None, scratch_mb: int | None = None, timeout_s: float = 300.0):
        self.arena_bytes = int((arena_mb or int(os.environ.get("EDGEPROBE_HVX_ARENA_MB", 768))) * 2**20)
        self.scratch_bytes = int((scratch_mb or 64) * 2**20)
        if self.scratch_bytes >= self.arena_bytes:
            raise ValueError("the arena must be larger than its scratch area")
        self.timeout_s = timeout_s
        self.lock = threading.RLock()
        self.proc: subprocess.Popen | None = None
        self.elf: Path | None = None
        self._fd = -1
        self._map = None
        self.mem: np.ndarray | None = None
        self._weights: dict = {}
        self._weights_end = self.scratch_bytes
        self._seq = 0
        self.calls = 0
        self.restarts = 0

    # ---- process and arena --------------------------------------------------------------------------
    def start(self) -> "HvxDsp":
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                return self
            if self.elf is None:
                self.elf = build()
            if self._fd < 0:  # the arena outlives a restarted process: weights stay where they were
                self._fd = os.memfd_create("edgeprobe-hvx-arena", 0)
                os.ftruncate(self._fd, self.arena_bytes)
                self._map = mmap.mmap(self._fd, self.arena_bytes)
                self.mem = np.frombuffer(self._map, np.uint8)
            self.proc = subprocess.Popen([QEMU, str(self.elf)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, pass_fds=(self._fd,))
            size, vec, version = self._call(OP_PING)[4:7]
            if (size, vec, version) != (MSG.size, VEC, VERSION):
                self._kill()
                raise HvxError(f"the Hexagon program speaks another format (struct {size} bytes, vectors {vec}, "
                               f"version {version}; expected {MSG.size}, {VEC}, {VERSION}): rebuild it")
            self._call(OP_INIT, k=self.arena_bytes, bufs=(self._fd,))
            return self

    def _ensure(self) -> None:
        """Start the process on first use (or after a death was reported); a death found here is reported first."""
        if self.proc is not None and self.proc.poll() is not None:
            raise self._died("died")
        if self.proc is None:
            self.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                f.close()
            self.proc = None

    def close(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                try:
                    self.proc.stdin.write(MSG.pack(MAGIC, OP_EXIT, 0, 0, *[0] * 16))
                    self.proc.stdin.flush()
                    self.proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._kill()
            self.mem = None
            if self._map is not None:
                self._map.close()
                self._map = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._weights.clear()
            self._weights_end = self.scratch_bytes

    def _died(self, what: str) -> HvxError:
        code = self.proc.poll() if self.proc is not None else None
        err = ""
        if self.proc is not None and code is not None:
            err = self.proc.stderr.read().decode(errors="replace")[-500:]
        pid = self.pid
        self._kill()
        self.restarts += 1
        how = "" if code is None else f" (killed by signal {-code})" if code < 0 else f" (exit code {code})"
        return HvxError(f"the Hexagon process (qemu-hexagon, pid {pid}) {what}{how}"
                        f"{': ' + err.strip() if err.strip() else ''}; the next call starts a new one")

    def _call(self, op: int, m: int = 0, k: int = 0, n: int = 0, flags: int = 0, bufs=(), scales=()) -> tuple:
        """One request, one reply (both the 80-byte struct). Raises HvxError on an error status or a lost process."""
        if self.proc is None or self.proc.poll() is not None:
            raise self._died("is not running")
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        b = (list(bufs) + [0] * 6)[:6]
        s = (list(scales) + [0] * 2)[:2]
        try:
            self.proc.stdin.write(MSG.pack(MAGIC, op, self._seq, 0, m, k, n, flags, *b, *s, 0, 0, 0, 0))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died("stopped taking requests") from None
        out, fd = b"", self.proc.stdout.fileno()
        while len(out) < MSG.size:
            ready, _, _ = select.select([fd], [], [], self.timeout_s)
            if not ready:
                raise self._died(f"gave no reply in {self.timeout_s:.0f} s and was stopped")
            chunk = os.read(fd, MSG.size - len(out))
            if not chunk:
                raise self._died("died")
            out += chunk
        reply = MSG.unpack(out)
        if reply[0] != MAGIC or reply[2] != self._seq:
            raise self._died("answered out of step")
        if reply[3]:
            raise HvxError(f"the Hexagon program refused op {op}: {STATUS.get(reply[3], reply[3])}")
        self.calls += 1
        return reply

    def _run(self, op: int, counters: dict | None, **kw) -> tuple:
        r = self._call(op, **kw)
        if counters is not None:
            c = {"packets": r[16], "insns": r[17], "hvx_insns": r[18], "scalar_packets": r[19]}
            for key, v in c.items():
                counters[key] = counters.get(key, 0) + int(v)
        return r

    # ---- arena allocation -----------------------------------------------------------------------------
    def _put(self, off: int, a: np.ndarray) -> None:
        b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self.mem[off:off + b.nbytes] = b

    def _get(self, off: int, dtype, shape) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.mem[off:off + n].view(dtype).reshape(shape).copy()

    def _scratch(self, *sizes: int) -> list[int]:
        offs, at = [], 0
        for s in sizes:
            offs.append(at)
            at += _align(int(s))
        if at > self.scratch_bytes:
            raise HvxError(f"a call needs {at / 2**20:.1f} MiB of buffers; the arena's scratch area holds "
                           f"{self.scratch_bytes / 2**20:.0f} MiB")
        return offs

    def weight(self, key, make) -> tuple[int, np.ndarray | None]:
        """Arena offset of the weight kept under key (make() -> the array to place, called when absent)."""
        with self.lock:
            self._ensure()
            hit = self._weights.get(key)
            if hit is not None:
                return hit
            a = np.ascontiguousarray(make())
            need = _align(a.nbytes)
            if need > self.arena_bytes - self.scratch_bytes:
                raise HvxError(f"a weight of {a.nbytes / 2**20:.1f} MiB does not fit the arena "
                               f"({(self.arena_bytes - self.scratch_bytes) / 2**20:.0f} MiB; EDGEPROBE_HVX_ARENA_MB)")
            if self._weights_end + need > self.arena_bytes:  # full: drop every weight, re-pack on use
                self._weights.clear()
                self._weights_end = self.scratch_bytes
            off = self._weights_end
            self._put(off, a)
            self._weights_end += need
            self._weights[key] = off
            return off

    # ---- kernels --------------------------------------------------------------------------------------
    def _packed(self, key, bt: np.ndarray) -> int | None:
        """Arena offset of bt packed for vrmpy, kept under key; None without a key (the call packs it into scratch)."""
        return None if key is None else self.weight(key, lambda: pack_weight(bt))

    def gemm_s8s32(self, a: np.ndarray, bt: np.ndarray, counters: dict | None = None, key=None) -> np.ndarray:
        """a int8[M, K] @ bt int8[K, N] -> int32[M, N], exact (vrmpy). key: keep the packed bt in the arena."""
        _check_int8(a, bt)
        M, K = a.shape
        N = bt.shape[1]
        Kp, Np = _align(K, 4), _align(N, 32)
        with self.lock:
            self._ensure()
            boff = self._packed(key, bt)
            ap = np.zeros((M, Kp), np.int8)
            ap[:, :K] = a
            aoff, coff, toff = self._scratch(M * Kp, M * Np * 4, 0 if boff is not None else Kp * Np)
            if boff is None:
                boff = toff
                self._put(boff, pack_weight(bt))
            self._put(aoff, ap)
            self._run(OP_GEMM_S8S32, counters, m=M, k=Kp, n=Np, bufs=(aoff, boff, coff))
            return self._get(coff, np.int32, (M, Np))[:, :N]

    def quantize(self, x: np.ndarray, scale_a: float, smooth: np.ndarray | None = None,
                 counters: dict | None = None) -> np.ndarray:
        """x float32[M, K] -> int8[M, K] = clip(rint(x / float32(scale_a)), -127, 127) (x / smooth first)."""
        x = _check_x(x, smooth)
        M, K = x.shape
        Kp = _align(K, 4)
        with self.lock:
            self._ensure()
            xoff, qoff, soff, xsoff = self._scratch(x.nbytes + OVERREAD, M * Kp, K * 4, x.nbytes + OVERREAD)
            self._put(xoff, x)
            if smooth is not None:
                self._put(soff, smooth.astype(np.float32))
            self._run(OP_QUANTIZE, counters, m=M, k=K, flags=FLAG_SMOOTH if smooth is not None else 0,
                      bufs=(xoff, 0, qoff, soff, xsoff), scales=(_f32_bits(scale_a),))
            return self._get(qoff, np.int8, (M, Kp))[:, :K]

    def w8a8(self, x: np.ndarray, bt: np.ndarray, scale_a: float, scale_w: float, smooth: np.ndarray | None = None,
             key=None, counters: dict | None = None) -> np.ndarray:
        """run_w8a8 on the DSP: float32(int8 GEMM of quantize(x / smooth, scale_a) and bt) * float32(scale_a * scale_w).
        x float32[M, K], bt int8[K, N], smooth float32[K] or None -> float32[M, N]. key: weight cache key."""
        x = _check_x(x, smooth)
        if not isinstance(bt, np.ndarray) or bt.dtype != np.int8 or bt.ndim != 2 or bt.shape[0] != x.shape[1] \
                or bt.shape[1] == 0:
            raise ValueError(f"w8a8 needs bt int8[{x.shape[1]}, N], got {getattr(bt, 'dtype', type(bt))}"
                             f"{getattr(bt, 'shape', '')}")
        M, K = x.shape
        N = bt.shape[1]
        Kp, Np = _align(K, 4), _align(N, 32)
        sa, so = _f32_bits(scale_a), _f32_bits(np.float32(scale_a * scale_w))  # the scale run_w8a8 multiplies by
        y = np.empty((M, N), np.float32)
        with self.lock:
            self._ensure()
            boff = self._packed(key, bt)
            sm = smooth is not None
            fixed = 4 * Np * 4 + K * 4 + 2 * OVERREAD + 6 * VEC + (0 if boff is not None else Kp * Np)
            per_row = K * 4 * (2 if sm else 1) + N * 4 + Kp
            rows = max(1, min(M, (self.scratch_bytes - fixed) // per_row))  # rows per call that fit the scratch
            for m0 in range(0, M, rows):
                xs = x[m0:m0 + rows]
                r = len(xs)
                scratch = _align(r * Kp) + 4 * Np * 4 + (xs.nbytes + OVERREAD if sm else 0)
                xoff, yoff, soff, scoff, toff = self._scratch(xs.nbytes + OVERREAD, r * N * 4, K * 4, scratch,
                                                              0 if key is not None else Kp * Np)
                if key is None:
                    boff = toff
                    self._put(boff, pack_weight(bt))
                self._put(xoff, xs)
                if smooth is not None:
                    self._put(soff, smooth.astype(np.float32))
                self._run(OP_W8A8, counters, m=r, k=K, n=N, flags=FLAG_SMOOTH if smooth is not None else 0,
                          bufs=(xoff, boff, yoff, soff, scoff), scales=(sa, so))
                y[m0:m0 + r] = self._get(yoff, np.float32, (r, N))
        return y

    def q4_tile_dequant(self, blocks: np.ndarray, counters: dict | None = None) -> np.ndarray:
        """Tile-group Q4_0 super-blocks uint8[S, 144] -> float16[S * 256] in stream order (vlut16)."""
        if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != SB_BYTES or not len(blocks):
            raise ValueError(f"q4_tile_dequant needs uint8[S, {SB_BYTES}] super-blocks, "
                             f"got {blocks.dtype}{blocks.shape}")
        S = len(blocks)
        out = np.empty(S * 256, np.float16)
        per_call = max(1, self.scratch_bytes // (SB_BYTES + 512 + 2 * VEC))
        with self.lock:
            self._ensure()
            for s0 in range(0, S, per_call):
                b = blocks[s0:s0 + per_call]
                boff, ooff = self._scratch(b.nbytes, len(b) * 512)
                self._put(boff, b)
                self._run(OP_Q4_TILE_DEQUANT, counters, m=len(b), bufs=(boff, 0, ooff))
                out[s0 * 256:(s0 + len(b)) * 256] = self._get(ooff, np.float16, (len(b) * 256,))
        return out

    def gemm_f16w(self, x: np.ndarray, w16: np.ndarray, key=None, counters: dict | None = None) -> np.ndarray:
        """x float32[M, K] -> float16(x) @ w16^T as float32[M, N]; w16 float16[N, K]. Summed in k order on the
        Hexagon scalar core (HMX's job on a phone): sums over k in order, bit-identical with kernels/f16_gemm.py."""
        x = _check_x(x, None)
        if not isinstance(w16, np.ndarray) or w16.dtype != np.float16 or w16.ndim != 2 or w16.shape[1] != x.shape[1]:
            raise ValueError(f"gemm_f16w needs w16 float16[N, {x.shape[1]}], got {getattr(w16, 'dtype', type(w16))}"
                             f"{getattr(w16, 'shape', '')}")
        M, K = x.shape
        N = w16.shape[0]
        y = np.empty((M, N), np.float32)
        with self.lock:
            self._ensure()
            make = lambda: w16.astype(np.float32)  # exact widening: the layout the scalar loop reads
            woff = None if key is None else self.weight(key, make)
            rows = max(1, min(M, (self.scratch_bytes - N * K * 4 * (woff is None) - 4 * VEC) // (K * 8 + N * 4)))
            for m0 in range(0, M, rows):
                xs = x[m0:m0 + rows]
                r = len(xs)
                xoff, yoff, hoff, toff = self._scratch(xs.nbytes, r * N * 4, xs.nbytes,
                                                       0 if woff is not None else N * K * 4)
                if key is None:
                    woff = toff
                    self._put(woff, make())
                self._put(xoff, xs)
                self._run(OP_GEMM_F16W, counters, m=r, k=K, n=N, bufs=(xoff, woff, yoff, 0, hoff))
                y[m0:m0 + r] = self._get(yoff, np.float32, (r, N))
                if key is None:
                    woff = None
        return y

    def exp_lut(self, x: np.ndarray, table: np.ndarray, counters: dict | None = None) -> np.ndarray:
        """float16 x (any shape, meant <= 0) -> float16 table[bits(x) & 0x7fff] (vgather). table: float16[32768]."""
        if table.dtype != np.float16 or table.shape != (32768,):
            raise ValueError(f"exp_lut needs a float16[32768] table, got {table.dtype}{table.shape}")
        x = np.asarray(x, np.float16)
        flat = x.reshape(-1)
        n = _align(max(len(flat), 1), 64)
        xp = np.zeros(n, np.float16)
        xp[:len(flat)] = flat
        with self.lock:
            self._ensure()
            toff = self.weight(("exp-table", hashlib.sha256(table.tobytes()).hexdigest()), lambda: table)
            xoff, ooff = self._scratch(n * 2, n * 2)
            self._put(xoff, xp)
            self._run(OP_EXP_LUT, counters, n=n, bufs=(xoff, toff, ooff))
            return self._get(ooff, np.float16, (n,))[:len(flat)].reshape(x.shape)

    def raw(self, op: int, m: int = 0, k: int = 0, n: int = 0, flags: int = 0, bufs=(), scales=()) -> tuple:
        """Send one request as given (tests: the program must refuse bad ones and keep serving)."""
        with self.lock:
            self._ensure()
            return self._call(op, m, k, n, flags, bufs, scales)


def _check_int8(a, bt):
    if not (isinstance(a, np.ndarray) and isinstance(bt, np.ndarray)) or a.dtype != np.int8 or bt.dtype != np.int8 \
            or a.ndim != 2 or bt.ndim != 2 or a.shape[1] != bt.shape[0] or 0 in a.shape or bt.shape[1] == 0:
        raise ValueError(f"gemm_s8s32 needs int8[M, K] and int8[K, N], got {getattr(a, 'dtype', type(a))}"
                         f"{getattr(a, 'shape', '')} and {getattr(bt, 'dtype', type(bt))}{getattr(bt, 'shape', '')}")


def _check_x(x, smooth) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or 0 in x.shape:
        raise ValueError(f"the DSP's linear takes float32[M, K] activations, got {getattr(x, 'dtype', type(x))}"
                         f"{getattr(x, 'shape', '')}")
    if x.shape[1] > MAX_K:
        raise ValueError(f"K = {x.shape[1]} exceeds the {MAX_K} input channels the Hexagon program supports")
    if smooth is not None and (smooth.shape != (x.shape[1],)):
        raise ValueError(f"smooth must be float32[{x.shape[1]}], got {smooth.dtype}{smooth.shape}")
    return np.ascontiguousarray(x)


_SHARED: HvxDsp | None = None
_SHARED_PID = 0  # the process that made _SHARED: a forked child inherits the object, not the QEMU process
EXIT_WAIT_S = 1.0  # at exit, how long a call in flight may keep the shared DSP's lock before its process is killed
_SHARED_LOCK = threading.Lock()


def shared() -> HvxDsp:
    """This process's DSP (one per agent); its process starts on first use and is stopped at this interpreter's
    exit (_close_shared)."""
    global _SHARED, _SHARED_PID
    with _SHARED_LOCK:
        if _SHARED is None:
            why = unavailable_reason()
            if why:
                raise HvxUnavailable(why)
            _SHARED, _SHARED_PID = HvxDsp(), os.getpid()
            atexit.register(_close_shared)
        return _SHARED


def _close_shared() -> None:
    """At exit, the shared DSP's QEMU is told to exit and its pipes closed (else the interpreter's teardown finds a
    running child and three open pipes); a forked child leaves its parent's alone. A call still running on a daemon
    thread (an agent's lane) holds the DSP's lock: then the process is killed, not waited for."""
    with _SHARED_LOCK:
        dsp = _SHARED if os.getpid() == _SHARED_PID else None
    if dsp is None:
        return
    if dsp.lock.acquire(timeout=EXIT_WAIT_S):
        try:
            dsp.close()
        finally:
            dsp.lock.release()
    else:
        proc = dsp.proc  # read once: the call's thread may drop it meanwhile
        if proc is not None:
            proc.kill()
