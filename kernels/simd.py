"""x86 AVX2 int8 dot products for numba kernels, as llama.cpp's CPU backend computes them.

LLVM vectorizes a plain int8 dot product (sign-extend to int32, multiply, add) with 8-byte vpmovsxbw and vpmaddwd
on 128-bit registers: 16 instructions per 32 bytes of weights, and a decode step's linears read 106 MB. With AVX2,
vpmaddubsw multiplies 32 unsigned by 32 signed bytes into 16 int16 pair sums in one instruction; fed |w| and a
carrying w's sign (vpsignb), every pair sum stays exact (|w| <= 128, |a| <= 127: 2 * 128 * 127 < 2^15), and
vpmaddwd against ones widens them to int32: 5 instructions per 32 bytes. The sums are the same integers, so the
kernels' bits do not change. `AVX2` says whether this CPU has it (numba's cache is keyed by the CPU's features,
so a kernel compiled here is never loaded on a CPU without them).
"""
from __future__ import annotations

try:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # the agent without numba (a phone): the BLAS paths, no kernels here
    numba = None


def _host_has_avx2() -> bool:
    try:
        import llvmlite.binding as ll

        return bool(ll.get_host_cpu_features().get("avx2"))
    except Exception:
        return False


AVX2 = numba is not None and _host_has_avx2()

if AVX2:
    @intrinsic
    def dot_s8_avx2(typingctx, a, w, n32):
        """sum over k < n32 of int32(a[k]) * int32(w[k]) -> int32; a int8[K] with |a| <= 127, w int8[K], both
        1-D C-contiguous, n32 a multiple of 32 (the caller adds the tail). Exact for K < 2^31 / (128 * 127)."""
        ok = all(isinstance(t, types.Array) and t.dtype == types.int8 and t.ndim == 1 and t.layout == "C" for t in (a, w))
        if not ok or not isinstance(n32, types.Integer):
            return None  # a typing error at compile time, never a wrong sum over a strided view

        def codegen(context, builder, sig, args):
            av_, wv_, n = args
            pa0 = context.make_array(sig.args[0])(context, builder, av_).data
            pw0 = context.make_array(sig.args[1])(context, builder, wv_).data
            i64 = ir.IntType(64)
            v32i8, v16i16, v8i32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(32), 8)
            fn = lambda ret, params, name: cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)
            psign = fn(v32i8, [v32i8, v32i8], "llvm.x86.avx2.psign.b")
            absb = fn(v32i8, [v32i8, ir.IntType(1)], "llvm.abs.v32i8")
            maddubs = fn(v16i16, [v32i8, v32i8], "llvm.x86.avx2.pmadd.ub.sw")
            maddwd = fn(v8i32, [v16i16, v16i16], "llvm.x86.avx2.pmadd.wd")
            reduce = fn(ir.IntType(32), [v8i32], "llvm.vector.reduce.add.v8i32")
            ones = ir.Constant(v16i16, [1] * 16)
            acc = cgutils.alloca_once_value(builder, ir.Constant(v8i32, [0] * 8))
            n = context.cast(builder, n, sig.args[2], types.int64)
            with cgutils.for_range(builder, builder.sdiv(n, ir.Constant(i64, 32))) as loop:
                off = builder.mul(loop.index, ir.Constant(i64, 32))
                x = builder.load(builder.bitcast(builder.gep(pa0, [off]), v32i8.as_pointer()), align=1)
                w8 = builder.load(builder.bitcast(builder.gep(pw0, [off]), v32i8.as_pointer()), align=1)
                signed = builder.call(psign, [x, w8])                    # a * sign(w)
                unsigned = builder.call(absb, [w8, ir.Constant(ir.IntType(1), 0)])  # |w|; -128 reads as 128 unsigned
                pairs = builder.call(maddubs, [unsigned, signed])        # 16 exact int16 pair sums
                builder.store(builder.add(builder.load(acc), builder.call(maddwd, [pairs, ones])), acc)
            return builder.call(reduce, [builder.load(acc)])
        return types.int32(a, w, n32), codegen
