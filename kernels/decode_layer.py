"""A Llama-style decoder layer for one decode row in compiled calls: what a fused decode layer's 15 ops compute
(RMSNorm, the q/k/v GEMV, RoPE, the KV cache write, attention, o, the residual adds, RMSNorm, gate/up, SwiGLU, down),
bit for bit, without the ~15 Python dispatches between them (a w8a8 step of SmolLM2-135M: ~0.2 ms of glue a layer
dispatched op by op on this project's 2-core test machine, against ~0.19 ms in its GEMVs). Its linears are W8A8
(int8_gemm's grouped GEMV) or q4_0-tile on the npu lane (f16_gemm's GEMV from 4-bit codes, the activations rounded
to FP16 by F16C): one compiled function serves both (_linear picks by which weights it is given).

Each part calls the kernel the op would call (llama_ops' numba kernels, the GEMVs). SwiGLU's exp is numpy's own,
called between two compiled calls or in an object-mode block: numba's float32 exp differs from numpy's in ~9% of
inputs, and the agent without numba (an arm64 phone) computes SwiGLU with numpy. The parts' cycle counts (the CPU's
counter) let the caller split the layer's measured time into the op kinds' shares, as dispatched ops report them.
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
from .simd import F16C

# the op kinds whose cycles layer_w8a8 counts, in its `ticks` array's order
PARTS = ("rms_norm", "linear", "rope", "attention", "add", "swiglu")

if numba is not None and AVX2:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    from .f16_gemm import _gemv_q4_dealt, q4_table
    from .int8_gemm import _linear_w8a8_group_nb
    from .llama_ops import _attention_few_nb, _rms_norm_nb, _rope_nb
    from .lut import _f16_values, _f32_to_f16_bits

    @intrinsic
    def _cycles(typingctx):
        """The CPU's cycle counter (rdtsc on x86): parts' shares of a layer, never a time by itself."""
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                                "llvm.readcyclecounter")
            return builder.call(fn, [])
        return types.int64(), codegen

    if F16C:
        @intrinsic
        def _f16_intrinsic(typingctx, v):
            if v != types.float32:
                return None

            def codegen(context, builder, sig, args):
                return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
            return types.float32(types.float32), codegen

        @numba.njit(inline="always")
        def _f16_round(v, f16_of):
            """A float32 rounded to FP16 (nearest even, past 65504 infinite) and back: x.astype(np.float16)'s value,
            the npu lane's A16 activations (F16C's vcvtps2ph)."""
            return _f16_intrinsic(v)
    else:
        @numba.njit(inline="always")
        def _f16_round(v, f16_of):
            return f16_of[_f32_to_f16_bits(v)]  # compiled, never run: q4_0-tile layers need F16C (layers_q4)

    @numba.njit(nogil=True, cache=True)
    def _linear_q4(h, codes, d16, f16_of, tab, tasks, out):
        """f16_gemm.gemv_q4_seq's bits for one row: h float32[1, K], codes/d16 the weight's (or siblings' side by
        side) row layout, out float32[1, N] its first N columns, dealt to `tasks` threads as gemv_q4_seq deals them."""
        K = h.shape[1]
        xh = np.zeros((1, 2 * codes.shape[0]), np.float32)
        for k in range(K):
            xh[0, k] = _f16_round(h[0, k], f16_of)
        _gemv_q4_dealt(xh, codes, d16, f16_of, tab, out, K, tasks)

    @numba.njit(nogil=True, cache=True)
    def _linear(h, g, c, out):
        """out float32[1, N] = h float32[1, K] through one GEMV: the W8A8 group g = (sa, part, w, scale) (its
        grouped GEMV, int8_gemm) where g's w has rows, else the q4_0-tile weight c = (codes, d16, f16_of, tab,
        tasks) (_linear_q4)."""
        if g[2].shape[0] > 0:
            _linear_w8a8_group_nb(h, g[0], g[1], g[2], g[3], out)
        else:
            _linear_q4(h, c[0], c[1], c[2], c[3], c[4], out)

    @numba.njit(nogil=True, cache=True)
    def _cols(g, c) -> int:
        """The columns _linear(h, g, c, out) computes."""
        return g[2].shape[0] if g[2].shape[0] > 0 else c[0].shape[1]

    @numba.njit(nogil=True, cache=True)
    def _layer_head(x, n1, eps1, g3, c3, ko, vo, H, KV, cos, sin, kc, vc, pos, window, scale64, softcap, go, co, n2,
                    eps2, g2, c2, F, ticks):
        """A layer up to SwiGLU's exp: -> (the attention residual float32[1, D], gate and up float32[1, _cols(g2,
        c2)], -gate float32[1, F] for numpy's exp). Each GEMV is (g, c) as _linear takes it: q, k, v one (k from
        column ko, v from vo), o one, gate and up one."""
        D = x.shape[1]
        t0 = _cycles()
        h = np.empty((1, D), np.float32)
        _rms_norm_nb(x, n1, eps1, h)
        t1 = _cycles()
        qkv = np.empty((1, _cols(g3, c3)), np.float32)
        _linear(h, g3, c3, qkv)
        t2 = _cycles()
        d = kc.shape[3]
        q = np.empty((1, 1, H, d), np.float32)
        _rope_nb(qkv[:, :H * d].copy().reshape(1, 1, H, d), cos, sin, q)
        k = np.empty((1, 1, KV, d), np.float32)
        _rope_nb(qkv[:, ko:ko + KV * d].copy().reshape(1, 1, KV, d), cos, sin, k)
        t3 = _cycles()
        for g in range(KV):  # KVSession.write: the new position's keys and values
            for j in range(d):
                kc[0, g, pos, j] = k[0, 0, g, j]
                vc[0, g, pos, j] = qkv[0, vo + g * d + j]
        a = np.empty((1, H * d), np.float32)
        _attention_few_nb(q, kc, vc, pos + 1, pos, window, scale64, softcap, a)
        t4 = _cycles()
        o = np.empty((1, D), np.float32)
        _linear(a, go, co, o)
        t5 = _cycles()
        r1 = x + o
        t6 = _cycles()
        h2 = np.empty((1, D), np.float32)
        _rms_norm_nb(r1, n2, eps2, h2)
        t7 = _cycles()
        gu = np.empty((1, _cols(g2, c2)), np.float32)
        _linear(h2, g2, c2, gu)
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
    def _layer_tail(r1, gu, e, uo, gd, cd, ticks):
        """A layer from SwiGLU's exp (e = exp(-gate), up from gu's column uo) on: -> the FFN residual float32[1, D]."""
        F = e.shape[1]
        t8 = _cycles()
        s = np.empty((1, F), np.float32)
        for j in range(F):  # g / (1 + exp(-g)) * u in float32, as swiglu_act's numpy expression rounds it
            s[0, j] = gu[0, j] / (np.float32(1.0) + e[0, j]) * gu[0, uo + j]
        t9 = _cycles()
        dn = np.empty((1, r1.shape[1]), np.float32)
        _linear(s, gd, cd, dn)
        t10 = _cycles()
        out = r1 + dn
        ticks[5] += t9 - t8
        ticks[1] += t10 - t9
        ticks[4] += _cycles() - t10
        return out

    # the unused half of a layer's GEMV arguments, empty, of the types _linear takes: a W8A8 layer's q4_0-tile
    # (codes, d16, f16_of, tab, tasks), a q4_0-tile layer's W8A8 (sa, part, w, scale)
    _NO_Q4 = (np.zeros((0, 0), np.uint8), np.zeros((0, 0), np.uint16), np.zeros(1, np.float32),
              np.zeros((1, 16), np.float32), 1)
    _NO_W8 = (np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros((0, 0), np.int8), np.zeros(0, np.float32))

    def layer_w8a8(x, n1, eps1, wqkv, sa3, part3, sc3, H, KV, cos, sin, kc, vc, pos, window, scale64, softcap,
                   wo, sao, parto, sco, n2, eps2, wgu, sa2, part2, sc2, wd, sad, partd, scd, ticks):
        """One decode row through a W8A8 layer. x float32[1, D]; n1, n2 float32[D] the norms' weights; wqkv
        int8[(H + 2 KV) d, D], wo int8[D, H d], wgu int8[2 F, D], wd int8[D, F] row-major stacked weights with their
        grouped GEMV's sa/part/scale (device_agent.ops.linear._group_weights); cos, sin float32[1, d / 2] at position
        pos; kc, vc float32[1, KV, capacity, d] the layer's KV cache, written at pos; window, scale64, softcap as
        attention's kernel takes them. ticks int64[len(PARTS)] += each part's cycles; -> (float32[1, D] the layer's
        output (the FFN residual), the ns numpy's exp took: SwiGLU's, outside the cycle counts). Two compiled calls
        around numpy's exp (an object-mode block would hold the GIL the calls release)."""
        d, F, c = kc.shape[3], wgu.shape[0] // 2, _NO_Q4
        r1, gu, e = _layer_head(x, n1, eps1, (sa3, part3, wqkv, sc3), c, H * d, (H + KV) * d, H, KV, cos, sin, kc, vc,
                                pos, window, scale64, softcap, (sao, parto, wo, sco), c, n2, eps2,
                                (sa2, part2, wgu, sc2), c, F, ticks)
        t = perf_counter_ns()
        np.exp(e, out=e)  # numpy's float32 exp: swiglu_act's bits
        t = perf_counter_ns() - t
        return _layer_tail(r1, gu, e, F, (sad, partd, wd, scd), c, ticks), t

    @numba.njit(nogil=True, cache=True)
    def _layers_nb(x, n1s, n2s, eps, w3s, sa3s, p3s, s3s, wos, saos, pos_, sos, w2s, sa2s, p2s, s2s, wds, sads, pds,
                   sds, c3s, d3s, cos_, dos, c2s, d2s, cds, dds, f16_of, tab, tasks, kcs, vcs, ko, vo, uo, F, H, KV,
                   cos, sin, pos, window, scale64, softcap, ticks, marks):
        for l in range(len(kcs)):
            g3, go = (sa3s[l], p3s[l], w3s[l], s3s[l]), (saos[l], pos_[l], wos[l], sos[l])
            g2, gd = (sa2s[l], p2s[l], w2s[l], s2s[l]), (sads[l], pds[l], wds[l], sds[l])
            c3, co = (c3s[l], d3s[l], f16_of, tab, tasks), (cos_[l], dos[l], f16_of, tab, tasks)
            c2, cd = (c2s[l], d2s[l], f16_of, tab, tasks), (cds[l], dds[l], f16_of, tab, tasks)
            marks[l, 0] = _cycles()
            r1, gu, e = _layer_head(x, n1s[l], eps[l, 0], g3, c3, ko, vo, H, KV, cos, sin, kcs[l], vcs[l], pos, window,
                                    scale64, softcap, go, co, n2s[l], eps[l, 1], g2, c2, F, ticks[l])
            t = _cycles()
            with numba.objmode():
                np.exp(e, out=e)  # numpy's float32 exp: swiglu_act's bits
            ticks[l, 5] += _cycles() - t
            x = _layer_tail(r1, gu, e, uo, gd, cd, ticks[l])
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

    def _layers(x, n1s, n2s, eps, w8, q4, f16_of, tab, tasks, kcs, vcs, ko, vo, uo, F, H, KV, cos, sin, pos, window,
                scale64, softcap, ticks, marks):
        args = (x, n1s, n2s, eps, *w8, *q4, f16_of, tab, tasks, kcs, vcs, ko, vo, uo, F, H, KV, cos, sin, pos, window,
                scale64, softcap, ticks, marks)
        if _called:
            return _layers_nb(*args)
        with _first, warnings.catch_warnings():  # the first call compiles (or loads) it: its one signature
            warnings.filterwarnings("ignore", "Code running in object mode won't allow parallel execution",
                                    numba.NumbaWarning)
            out = _layers_nb(*args)
            _called.append(True)
        return out

    def empty_lists(kind: str, L: int) -> list:
        """The other scheme's typed lists of L layers, empty arrays of the types _layers_nb takes: kind "q4" the 8
        of layers_w8a8 (codes, d16 of each GEMV), "w8" the 16 of layers_q4 (w, sa, part, scale of each)."""
        sa, part, w, scale = _NO_W8
        arrays = _NO_Q4[:2] if kind == "q4" else (w, sa, part, scale)
        return [typed_list([a] * L) for _ in range(4) for a in arrays]

    def layers_w8a8(x, n1s, n2s, eps, w3s, sa3s, p3s, s3s, wos, saos, pos_, sos, w2s, sa2s, p2s, s2s, wds, sads, pds,
                    sds, kcs, vcs, H, KV, cos, sin, pos, window, scale64, softcap, ticks, marks, none=None):
        """Consecutive decode layers, each layer_w8a8's, in one call: x float32[1, D] into the first; n1s, n2s
        float32[L, D]; eps float32[L, 2] the two norms'; the rest typed lists of each layer's layer_w8a8 arrays
        (w3s its wqkv, ...; kcs, vcs its KV cache) and the layers' shared H, KV, cos, sin, pos, window, scale64,
        softcap. ticks int64[L, len(PARTS)] += each layer's parts' cycles, numpy's exp in SwiGLU's; marks int64[L, 2]
        = each layer's first and last cycle count. -> the last layer's output float32[1, D]. numpy's exp runs in an
        object-mode block (the GIL taken for it alone); numba warns at compiling one in a function that releases the
        GIL, which here is the point: that warning is silenced, once, for this function. none: empty_lists("q4", L)
        (made here where not given: a caller running the same layers again keeps them)."""
        d, F = kcs[0].shape[3], w2s[0].shape[0] // 2
        return _layers(x, n1s, n2s, eps, [w3s, sa3s, p3s, s3s, wos, saos, pos_, sos, w2s, sa2s, p2s, s2s, wds, sads,
                                          pds, sds], none or empty_lists("q4", len(kcs)), *_NO_Q4[2:], kcs, vcs,
                       H * d, (H + KV) * d, F, F, H, KV, cos, sin, pos, window, scale64, softcap, ticks, marks)

    if F16C:
        def layers_q4(x, n1s, n2s, eps, c3s, d3s, cos_, dos, c2s, d2s, cds, dds, kcs, vcs, ko, vo, uo, F, H, KV, cos,
                      sin, pos, window, scale64, softcap, ticks, marks, none=None):
            """layers_w8a8 for q4_0-tile layers on the npu lane, the bits of their sub-ops (f16_gemm.gemv_q4_seq's
            GEMVs, the activations rounded to FP16 by F16C): c3s/d3s, cos_/dos, c2s/d2s, cds/dds typed lists of each
            layer's codes and scales (tiles_q4_rows) of q, k, v side by side (k from column ko, v from vo), o, gate
            and up side by side (up from column uo; F the FFN's width), down. none: empty_lists("w8", L)."""
            return _layers(x, n1s, n2s, eps, none or empty_lists("w8", len(kcs)),
                           [c3s, d3s, cos_, dos, c2s, d2s, cds, dds], _f16_values(), q4_table(),
                           max(1, numba.get_num_threads()), kcs, vcs, ko, vo, uo, F, H, KV, cos, sin, pos, window,
                           scale64, softcap, ticks, marks)
    else:  # no F16C: q4_0-tile layers run op by op
        layers_q4 = None
else:  # no numba (a phone's Python) or no AVX2: fused layers run op by op
    layer_w8a8 = layers_w8a8 = layers_q4 = typed_list = empty_lists = None
