"""OpenCL GEMMs for the agent's `gpu` lane (PoCL on this CPU, Adreno on a phone), through pyopencl.

FP16: PoCL has no `cl_khr_fp16`, and many phone drivers expose half storage but not half arithmetic
everywhere. So FP16 weights are *stored* as half (2 bytes, as on the device) and read with
`vload_half4`, which OpenCL 1.2 defines without any extension; arithmetic is FP32. The int8 GEMM
widens char16 to short and accumulates in int32, blocked 4 rows per work-item (≈110 GOP/s on PoCL
here, MACHINE.md). pyopencl releases the GIL while a kernel runs, so this lane overlaps the others.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .paths import cache_root

# y[m, n] = sum_k x[m, k] * w[n, k]; 4 rows of x per work-item, float4 along K (K % 4 == 0).
# One body, two weight formats: float32 weights, or FP16 weights in half storage read with vload_half4
# (core OpenCL, no cl_khr_fp16 needed).
_FLOAT_GEMM = r"""
__kernel void NAME(__global const float4 *x, __global const WTYPE *w, __global float *y,
                   const int M, const int N, const int K4) {
    const int n = get_global_id(0), m0 = get_global_id(1) * 4;
    if (n >= N) return;
    float4 a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (int k = 0; k < K4; ++k) {
        const float4 b = LOAD_B;
        if (m0 + 0 < M) a0 += x[(size_t)(m0 + 0) * K4 + k] * b;
        if (m0 + 1 < M) a1 += x[(size_t)(m0 + 1) * K4 + k] * b;
        if (m0 + 2 < M) a2 += x[(size_t)(m0 + 2) * K4 + k] * b;
        if (m0 + 3 < M) a3 += x[(size_t)(m0 + 3) * K4 + k] * b;
    }
    if (m0 + 0 < M) y[(size_t)(m0 + 0) * N + n] = a0.x + a0.y + a0.z + a0.w;
    if (m0 + 1 < M) y[(size_t)(m0 + 1) * N + n] = a1.x + a1.y + a1.z + a1.w;
    if (m0 + 2 < M) y[(size_t)(m0 + 2) * N + n] = a2.x + a2.y + a2.z + a2.w;
    if (m0 + 3 < M) y[(size_t)(m0 + 3) * N + n] = a3.x + a3.y + a3.z + a3.w;
}
"""

SOURCE = (_FLOAT_GEMM.replace("NAME", "gemm_f32").replace("WTYPE", "float4")
          .replace("LOAD_B", "w[(size_t)n * K4 + k]")
          + _FLOAT_GEMM.replace("NAME", "gemm_f16w").replace("WTYPE", "half")
          .replace("LOAD_B", "vload_half4((size_t)n * K4 + k, w)")
          + r"""
// c[m, n] = sum_k a[m, k] * w[n, k], int8 x int8 -> int32; char16 widened to short16 (K % 16 == 0)
__kernel void gemm_s8s32(__global const char16 *a, __global const char16 *w, __global int *c,
                         const int M, const int N, const int K16) {
    const int n = get_global_id(0), m0 = get_global_id(1) * 4;
    if (n >= N) return;
    // vector accumulators, reduced once at the end (a horizontal sum per step costs more than the math)
    int8 acc0 = 0, acc1 = 0, acc2 = 0, acc3 = 0;
    const int r1 = min(m0 + 1, M - 1), r2 = min(m0 + 2, M - 1), r3 = min(m0 + 3, M - 1);
    for (int k = 0; k < K16; ++k) {
        const short16 b = convert_short16(w[(size_t)n * K16 + k]);
        short16 p = convert_short16(a[(size_t)m0 * K16 + k]) * b;
        acc0 += convert_int8(p.lo) + convert_int8(p.hi);
        p = convert_short16(a[(size_t)r1 * K16 + k]) * b;
        acc1 += convert_int8(p.lo) + convert_int8(p.hi);
        p = convert_short16(a[(size_t)r2 * K16 + k]) * b;
        acc2 += convert_int8(p.lo) + convert_int8(p.hi);
        p = convert_short16(a[(size_t)r3 * K16 + k]) * b;
        acc3 += convert_int8(p.lo) + convert_int8(p.hi);
    }
    int4 t;
    t = acc0.lo + acc0.hi; c[(size_t)m0 * N + n] = t.x + t.y + t.z + t.w;
    t = acc1.lo + acc1.hi; if (m0 + 1 < M) c[(size_t)(m0 + 1) * N + n] = t.x + t.y + t.z + t.w;
    t = acc2.lo + acc2.hi; if (m0 + 2 < M) c[(size_t)(m0 + 2) * N + n] = t.x + t.y + t.z + t.w;
    t = acc3.lo + acc3.hi; if (m0 + 3 < M) c[(size_t)(m0 + 3) * N + n] = t.x + t.y + t.z + t.w;
}
""")


class OpenCLGemm:
    """One OpenCL context + queue (one lane); weight buffers are cached by key (a blob id)."""

    def __init__(self, device_index: int = 0):
        import pyopencl as cl

        os.environ.setdefault("POCL_CACHE_DIR", str(cache_root() / "pocl"))
        devices = [d for p in cl.get_platforms() for d in p.get_devices()]
        if not devices:
            raise RuntimeError("no OpenCL device (install an ICD: Debian pocl-opencl-icd, or a phone GPU driver)")
        self.cl = cl
        self.device = devices[device_index]
        self.ctx = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.ctx)
        self.prg = cl.Program(self.ctx, SOURCE).build()
        self._k = {n: getattr(self.prg, n) for n in ("gemm_f32", "gemm_f16w", "gemm_s8s32")}
        self._weights: dict = {}
        self.local = None  # work-group size; None lets the driver choose
        self._lock = threading.Lock()

    def _weight(self, key, make) -> object:
        with self._lock:
            buf = self._weights.get(key)
            if buf is None:
                arr = np.ascontiguousarray(make())
                flags = self.cl.mem_flags.READ_ONLY | self.cl.mem_flags.COPY_HOST_PTR
                buf = self._weights[key] = (self.cl.Buffer(self.ctx, flags, hostbuf=arr), arr.shape)
            return buf

    def _run(self, kernel: str, x: np.ndarray, wbuf, N: int, kdiv: int, out_dtype) -> np.ndarray:
        cl = self.cl
        M, K = x.shape
        xb = cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(x))
        y = np.empty((M, N), out_dtype)
        yb = cl.Buffer(self.ctx, cl.mem_flags.WRITE_ONLY, y.nbytes)
        with self._lock:  # setting a kernel's arguments and enqueueing it is one step: runs on two threads share it
            self._k[kernel](self.queue, (N, -(-M // 4)), self.local, xb, wbuf, yb, np.int32(M), np.int32(N),
                            np.int32(K // kdiv))
        cl.enqueue_copy(self.queue, y, yb)  # blocking: waits (GIL released) for the kernel
        return y

    def gemm_f32(self, x: np.ndarray, w: np.ndarray, key=None) -> np.ndarray:
        """x float32[M, K] @ w float32[N, K]^T -> float32[M, N]; K is zero-padded to a multiple of 4."""
        K = x.shape[1]
        Kp = -(-K // 4) * 4
        wbuf, _ = self._weight(("f32", key if key is not None else id(w)), lambda: _pad(np.asarray(w, np.float32), Kp))
        return self._run("gemm_f32", _pad(np.asarray(x, np.float32), Kp), wbuf, w.shape[0], 4, np.float32)

    def gemm_f16w(self, x: np.ndarray, w16: np.ndarray, key=None) -> np.ndarray:
        """x float32[M, K] @ w float16[N, K]^T (half storage, FP32 math) -> float32[M, N]."""
        K = x.shape[1]
        Kp = -(-K // 4) * 4
        wbuf, _ = self._weight(("f16", key if key is not None else id(w16)),
                               lambda: _pad(np.asarray(w16, np.float16), Kp))
        return self._run("gemm_f16w", _pad(np.asarray(x, np.float32), Kp), wbuf, w16.shape[0], 4, np.float32)

    def gemm_s8s32(self, a: np.ndarray, w: np.ndarray, key=None) -> np.ndarray:
        """a int8[M, K] @ w int8[N, K]^T -> int32[M, N], exact; K zero-padded to a multiple of 16."""
        K = a.shape[1]
        Kp = -(-K // 16) * 16
        wbuf, _ = self._weight(("s8", key if key is not None else id(w)), lambda: _pad(np.asarray(w, np.int8), Kp))
        return self._run("gemm_s8s32", _pad(np.asarray(a, np.int8), Kp), wbuf, w.shape[0], 16, np.int32)


def _pad(a: np.ndarray, Kp: int) -> np.ndarray:
    if a.shape[1] == Kp:
        return np.ascontiguousarray(a)
    out = np.zeros((a.shape[0], Kp), a.dtype)
    out[:, :a.shape[1]] = a
    return out


_SHARED: OpenCLGemm | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> OpenCLGemm:
    """The process's OpenCL runtime (built once, even when two runs' gpu lanes ask at once; program binaries
    cached by PoCL across processes)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = OpenCLGemm()
        return _SHARED
