"""A Llama-style W8A8 decoder layer for one decode row in two compiled calls: what a fused decode layer's 15 ops
compute (RMSNorm, the q/k/v GEMV, RoPE, the KV cache write, attention, o, the residual adds, RMSNorm, gate/up,
SwiGLU, down), bit for bit, without the ~15 Python dispatches between them (a w8a8 step of SmolLM2-135M: ~0.2 ms
of glue a layer dispatched op by op on this project's 2-core test machine, against ~0.19 ms in its GEMVs).

Each part calls the kernel the op would call (llama_ops' numba kernels, int8_gemm's grouped GEMV). SwiGLU's exp is
numpy's own, called between the two compiled calls: numba's float32 exp differs from numpy's in ~9% of inputs, and
the agent without numba (an arm64 phone) computes SwiGLU with numpy. The parts' cycle counts (the CPU's counter)
let the caller split the layer's measured time into the op kinds' shares, as dispatched ops report them.
numba's cache of these functions holds the kernels they call, and it is keyed by this file alone: after changing
one of those kernels in a working tree, delete kernels/__pycache__/decode_layer.* (tests/test_compiled_layer.py
compares the two paths bit for bit and fails on a stale cache).
"""
from __future__ import annotations

import threading
import warnings
from time import perf_counter_ns

import numpy as np

try:
    import numba
except ImportError:
    numba = None

from .int8_gemm import AVX2

# the op kinds whose cycles layer_w8a8 counts, in its `ticks` array's order
PARTS = ("rms_norm", "linear", "rope", "attention", "add", "swiglu")

if numba is not None and AVX2:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    from .int8_gemm import _linear_w8a8_group_nb
    from .llama_ops import _attention_few_nb, _rms_norm_nb, _rope_nb

    @intrinsic
    def _cycles(typingctx):
        """The CPU's cycle counter (rdtsc on x86): parts' shares of a layer, never a time by itself."""
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                                "llvm.readcyclecounter")
            return builder.call(fn, [])
        return types.int64(), codegen

    @numba.njit(nogil=True, cache=True)
    def _layer_head(x, n1, eps1, wqkv, sa3, part3, sc3, H, KV, cos, sin, kc, vc, pos, window, scale64, softcap,
                    wo, sao, parto, sco, n2, eps2, wgu, sa2, part2, sc2, ticks):
        """layer_w8a8 up to SwiGLU's exp: -> (the attention residual float32[1, D], gate and up float32[1, 2 F],
        -gate float32[1, F] for numpy's exp)."""
        D = x.shape[1]
        d = kc.shape[3]
        F = wgu.shape[0] // 2
        t0 = _cycles()
        h = np.empty((1, D), np.float32)
        _rms_norm_nb(x, n1, eps1, h)
        t1 = _cycles()
        qkv = np.empty((1, wqkv.shape[0]), np.float32)
        _linear_w8a8_group_nb(h, sa3, part3, wqkv, sc3, qkv)
        t2 = _cycles()
        q = np.empty((1, 1, H, d), np.float32)
        _rope_nb(qkv[:, :H * d].copy().reshape(1, 1, H, d), cos, sin, q)
        k = np.empty((1, 1, KV, d), np.float32)
        _rope_nb(qkv[:, H * d:(H + KV) * d].copy().reshape(1, 1, KV, d), cos, sin, k)
        t3 = _cycles()
        for g in range(KV):  # KVSession.write: the new position's keys and values
            for j in range(d):
                kc[0, g, pos, j] = k[0, 0, g, j]
                vc[0, g, pos, j] = qkv[0, (H + KV + g) * d + j]
        a = np.empty((1, H * d), np.float32)
        _attention_few_nb(q, kc, vc, pos + 1, pos, window, scale64, softcap, a)
        t4 = _cycles()
        o = np.empty((1, D), np.float32)
        _linear_w8a8_group_nb(a, sao, parto, wo, sco, o)
        t5 = _cycles()
        r1 = x + o
        t6 = _cycles()
        h2 = np.empty((1, D), np.float32)
        _rms_norm_nb(r1, n2, eps2, h2)
        t7 = _cycles()
        gu = np.empty((1, 2 * F), np.float32)
        _linear_w8a8_group_nb(h2, sa2, part2, wgu, sc2, gu)
        t8 = _cycles()
        e = -gu[:, :F]
        ticks[0] += (t1 - t0) + (t7 - t6)
        ticks[1] += (t2 - t1) + (t5 - t4) + (t8 - t7)
        ticks[2] += t3 - t2
        ticks[3] += t4 - t3
        ticks[4] += t6 - t5
        ticks[5] += _cycles() - t8
        return r1, gu, e

    @numba.njit(nogil=True, cache=True)
    def _layer_tail(r1, gu, e, wd, sad, partd, scd, ticks):
        """layer_w8a8 from SwiGLU's exp (e = exp(-gate)) on: -> the FFN residual float32[1, D]."""
        F = e.shape[1]
        t8 = _cycles()
        s = np.empty((1, F), np.float32)
        for j in range(F):  # g / (1 + exp(-g)) * u in float32, as swiglu_act's numpy expression rounds it
            s[0, j] = gu[0, j] / (np.float32(1.0) + e[0, j]) * gu[0, F + j]
        t9 = _cycles()
        dn = np.empty((1, r1.shape[1]), np.float32)
        _linear_w8a8_group_nb(s, sad, partd, wd, scd, dn)
        t10 = _cycles()
        out = r1 + dn
        ticks[5] += t9 - t8
        ticks[1] += t10 - t9
        ticks[4] += _cycles() - t10
        return out

    def layer_w8a8(x, n1, eps1, wqkv, sa3, part3, sc3, H, KV, cos, sin, kc, vc, pos, window, scale64, softcap,
                   wo, sao, parto, sco, n2, eps2, wgu, sa2, part2, sc2, wd, sad, partd, scd, ticks):
        """One decode row through a layer. x float32[1, D]; n1, n2 float32[D] the norms' weights; wqkv int8[(H + 2 KV)
        d, D], wo int8[D, H d], wgu int8[2 F, D], wd int8[D, F] row-major stacked weights with their grouped GEMV's
        sa/part/scale (device_agent.ops.linear._group_weights); cos, sin float32[1, d / 2] at position pos; kc, vc
        float32[1, KV, capacity, d] the layer's KV cache, written at pos; window, scale64, softcap as attention's
        kernel takes them. ticks int64[len(PARTS)] += each part's cycles; -> (float32[1, D] the layer's output (the
        FFN residual), the ns numpy's exp took: SwiGLU's, outside the cycle counts). Two compiled calls around
        numpy's exp (an object-mode block would hold the GIL the calls release)."""
        r1, gu, e = _layer_head(x, n1, eps1, wqkv, sa3, part3, sc3, H, KV, cos, sin, kc, vc, pos, window, scale64,
                                softcap, wo, sao, parto, sco, n2, eps2, wgu, sa2, part2, sc2, ticks)
        t = perf_counter_ns()
        np.exp(e, out=e)  # numpy's float32 exp: swiglu_act's bits
        t = perf_counter_ns() - t
        return _layer_tail(r1, gu, e, wd, sad, partd, scd, ticks), t

    @numba.njit(nogil=True, cache=True)
    def _layers_nb(x, n1s, n2s, eps, w3s, sa3s, p3s, s3s, wos, saos, pos_, sos, w2s, sa2s, p2s, s2s, wds, sads, pds,
                   sds, kcs, vcs, H, KV, cos, sin, pos, window, scale64, softcap, ticks, marks):
        for l in range(len(w3s)):
            marks[l, 0] = _cycles()
            r1, gu, e = _layer_head(x, n1s[l], eps[l, 0], w3s[l], sa3s[l], p3s[l], s3s[l], H, KV, cos, sin, kcs[l],
                                    vcs[l], pos, window, scale64, softcap, wos[l], saos[l], pos_[l], sos[l], n2s[l],
                                    eps[l, 1], w2s[l], sa2s[l], p2s[l], s2s[l], ticks[l])
            t = _cycles()
            with numba.objmode():
                np.exp(e, out=e)  # numpy's float32 exp: swiglu_act's bits
            ticks[l, 5] += _cycles() - t
            x = _layer_tail(r1, gu, e, wds[l], sads[l], pds[l], sds[l], ticks[l])
            marks[l, 1] = _cycles()
        return x

    def typed_list(arrays: list):
        """A numba typed list of arrays of one type: a layers_w8a8 argument, unboxed in O(1)."""
        out = numba.typed.List()
        for a in arrays:
            out.append(a)
        return out

    _first = threading.Lock()
    _called: list = []

    def layers_w8a8(x, n1s, n2s, eps, w3s, sa3s, p3s, s3s, wos, saos, pos_, sos, w2s, sa2s, p2s, s2s, wds, sads, pds,
                    sds, kcs, vcs, H, KV, cos, sin, pos, window, scale64, softcap, ticks, marks):
        """Consecutive decode layers, each layer_w8a8's, in one call: x float32[1, D] into the first; n1s, n2s
        float32[L, D]; eps float32[L, 2] the two norms'; the rest typed lists of each layer's layer_w8a8 arrays
        (w3s its wqkv, ...; kcs, vcs its KV cache) and the layers' shared H, KV, cos, sin, pos, window, scale64,
        softcap. ticks int64[L, len(PARTS)] += each layer's parts' cycles, numpy's exp in SwiGLU's; marks int64[L, 2]
        = each layer's first and last cycle count. -> the last layer's output float32[1, D]. numpy's exp runs in an
        object-mode block (the GIL taken for it alone); numba warns at compiling one in a function that releases the
        GIL, which here is the point: that warning is silenced, once, for this function."""
        args = (x, n1s, n2s, eps, w3s, sa3s, p3s, s3s, wos, saos, pos_, sos, w2s, sa2s, p2s, s2s, wds, sads, pds, sds,
                kcs, vcs, H, KV, cos, sin, pos, window, scale64, softcap, ticks, marks)
        if _called:
            return _layers_nb(*args)
        with _first, warnings.catch_warnings():  # the first call compiles (or loads) it: its one signature
            warnings.filterwarnings("ignore", "Code running in object mode won't allow parallel execution",
                                    numba.NumbaWarning)
            out = _layers_nb(*args)
            _called.append(True)
        return out
else:  # no numba (a phone's Python) or no AVX2: fused layers run op by op
    layer_w8a8 = layers_w8a8 = typed_list = None
