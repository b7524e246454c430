"""x86 AVX2 int8 dot products for numba kernels, as llama.cpp's CPU backend computes them.

LLVM vectorizes a plain int8 dot product (sign-extend to int32, multiply, add) with 8-byte vpmovsxbw and vpmaddwd
on 128-bit registers: 16 instructions per 32 bytes of weights, and a decode step's linears read 106 MB. With AVX2,
vpmaddubsw multiplies 32 unsigned by 32 signed bytes into 16 int16 pair sums in one instruction; fed |w| and a
carrying w's sign (vpsignb), every pair sum stays exact (|w| <= 128, |a| <= 127: 2 * 128 * 127 < 2^15), and
vpmaddwd against ones widens them to int32: 5 instructions per 32 bytes. The sums are the same integers, so the
kernels' bits do not change. A prefill GEMM (`dot4x2_s8_avx2`) keeps a 4 x 2 block of such dots in registers:
1.4-3x the float32 BLAS path on int8 codes here (bench/quant.py). `AVX2` says whether this CPU has it (numba's cache
is keyed by the CPU's features, so a kernel compiled here is never loaded on a CPU without them).

With AVX-512 VNNI (Intel since Ice Lake, AMD since Zen 4), vpdpbusd multiplies 64 unsigned by 64 signed bytes and
adds each 4 products into 16 int32 lanes, exactly (no int16 saturation), in one instruction. The activations are
then fed as a + 128 (unsigned), and the caller subtracts 128 * sum(w) per output channel: the same int32 sums with
one instruction per 64 bytes a dot product, where the AVX2 path spends four per 32 (`dot4x4_u8s8_vnni`). `VNNI`
says whether this CPU has it (EDGEPROBE_VNNI=0 keeps the AVX2 kernels, for A/B runs).

The q4_0-tile GEMV (`q4_cols64_f16`, NPU test-time scaling §5) dequantizes each 4-bit code to the FP16 value vlut16
gives and adds x w into float32 sums in k order. Written as LLVM IR, 64 columns keep their sums in 8 registers over
every row pair (the numba loop of f16_gemm loads and stores them, and runs a scalar block, per group of 32 weights),
the FP16 rounding is F16C's vcvtps2ph and each exact product's add one FMA: the same bits. `F16C` says whether this
CPU has F16C and FMA. The rounding bounds it on an AVX2 CPU (bench/decode_overhead.py; docs/benchmarks.md). With
AVX-512 a group's 16 columns are one register: its scale's 16 values fp16((q - 8) d), vlut16's table, are one row of
a table of every FP16 scale's (f16_gemm.q4_table, 4 MiB; SmolLM2-135M reads 10,243 of its rows), and each code
looks its value up with vpermps (2.1x the 8-lane columns on one core of an AVX-512 EPYC). `Q4_LANES` says which
(EDGEPROBE_AVX512=0 keeps 8 lanes, for A/B runs: with a NUMBA_CACHE_DIR of its own, as numba keys its cache by the
source, not the setting).
"""
from __future__ import annotations

import os

try:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # the agent without numba (a phone): the BLAS paths, no kernels here
    numba = None


def _host_has(*features: str) -> bool:
    try:
        import llvmlite.binding as ll

        have = ll.get_host_cpu_features()
        return all(have.get(f) for f in features)
    except Exception:
        return False


AVX2 = numba is not None and _host_has("avx2")
VNNI = AVX2 and _host_has("avx512f", "avx512bw", "avx512vnni") and os.environ.get("EDGEPROBE_VNNI", "1") != "0"
VNNI_STEP = 64  # bytes of K per vpdpbusd (one zmm register)

if AVX2:
    def _emit_dots(context, builder, pa: list, pw: list, n):
        """LLVM IR for every sum over k < n of int32(a_i[k]) * int32(w_j[k]) (pa, pw: int8 pointers, n an int64 multiple
        of 32) -> int32 values, row-major over (i, j): each 32 bytes of w_j are made |w_j| once for all the a_i."""
        i64 = ir.IntType(64)
        v32i8, v16i16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16)
        v8i32 = ir.VectorType(ir.IntType(32), 8)
        fn = lambda ret, params, name: cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ret, params), name)
        psign = fn(v32i8, [v32i8, v32i8], "llvm.x86.avx2.psign.b")
        absb = fn(v32i8, [v32i8, ir.IntType(1)], "llvm.abs.v32i8")
        maddubs = fn(v16i16, [v32i8, v32i8], "llvm.x86.avx2.pmadd.ub.sw")
        maddwd = fn(v8i32, [v16i16, v16i16], "llvm.x86.avx2.pmadd.wd")
        reduce = fn(ir.IntType(32), [v8i32], "llvm.vector.reduce.add.v8i32")
        ones = ir.Constant(v16i16, [1] * 16)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v8i32, [0] * 8)) for _ in range(len(pa) * len(pw))]
        load = lambda p, off: builder.load(builder.bitcast(builder.gep(p, [off]), v32i8.as_pointer()), align=1)
        with cgutils.for_range(builder, builder.sdiv(n, ir.Constant(i64, 32))) as loop:
            off = builder.mul(loop.index, ir.Constant(i64, 32))
            ws = [load(p, off) for p in pw]
            unsigned = [builder.call(absb, [w8, ir.Constant(ir.IntType(1), 0)]) for w8 in ws]  # |w|; -128 reads as 128
            for i, p in enumerate(pa):
                x = load(p, off)
                for j, w8 in enumerate(ws):
                    # 16 exact int16 pair sums of |w| * a*sign(w)
                    pairs = builder.call(maddubs, [unsigned[j], builder.call(psign, [x, w8])])
                    acc = accs[i * len(pw) + j]
                    builder.store(builder.add(builder.load(acc), builder.call(maddwd, [pairs, ones])), acc)
        return [builder.call(reduce, [builder.load(acc)]) for acc in accs]

    def _rows(builder, arr, r, count: int) -> list:
        """Pointers to rows r..r + count - 1 of a 2-D C-contiguous array (its numba struct), as LLVM IR."""
        stride = builder.extract_value(arr.strides, 0)
        return [builder.gep(arr.data, [builder.mul(builder.add(r, ir.Constant(ir.IntType(64), k)), stride)])
                for k in range(count)]

    def _block_codegen(emit, rows: int, cols: int):
        """The codegen of a register-block intrinsic (a, w, m0, n0, n): emit(context, builder, pa, pw, n)'s sums of
        rows m0.. of a against rows n0.. of w, as a tuple."""
        def codegen(context, builder, sig, args):
            aa = context.make_array(sig.args[0])(context, builder, args[0])
            ww = context.make_array(sig.args[1])(context, builder, args[1])
            m0, n0, n = (context.cast(builder, v, t, types.int64) for v, t in zip(args[2:], sig.args[2:]))
            vals = emit(context, builder, _rows(builder, aa, m0, rows), _rows(builder, ww, n0, cols), n)
            return context.make_tuple(builder, sig.return_type, vals)
        return codegen

    def _c_arrays(ok_ndim, *ts, dtype=types.int8):
        return all(isinstance(t, types.Array) and t.dtype == dtype and t.ndim == ok_ndim and t.layout == "C"
                   for t in ts)

    def _emit_dots_vnni(context, builder, pa: list, pw: list, n):
        """LLVM IR for every sum over k < n of int32(a_i[k]) * int32(w_j[k]) (pa: uint8 pointers, pw: int8 pointers,
        n an int64 multiple of VNNI_STEP) -> int32 values, row-major over (i, j): one vpdpbusd per 64 bytes of a
        pair, the accumulators' lanes summed by one transpose-add tree (_lane_sums)."""
        return _lane_sums(builder, _emit_dot_vectors(context, builder, pa, pw, n))

    def _emit_dot_vectors(context, builder, pa: list, pw: list, n):
        """_emit_dots_vnni's accumulators, unreduced: <16 x i32> vectors row-major over (i, j)."""
        i64 = ir.IntType(64)
        vbytes, vacc = ir.VectorType(ir.IntType(8), VNNI_STEP), ir.VectorType(ir.IntType(32), VNNI_STEP // 4)
        # the <16 x i32> operand form: LLVM releases that declare <64 x i8> upgrade it when they read the IR
        dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vacc, [vacc] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vacc, [0] * vacc.count))
                for _ in range(len(pa) * len(pw))]
        load = lambda p, off: builder.bitcast(
            builder.load(builder.bitcast(builder.gep(p, [off]), vbytes.as_pointer()), align=1), vacc)
        with cgutils.for_range(builder, builder.sdiv(n, ir.Constant(i64, VNNI_STEP))) as loop:
            off = builder.mul(loop.index, ir.Constant(i64, VNNI_STEP))
            ws = [load(p, off) for p in pw]
            for i, p in enumerate(pa):
                x = load(p, off)
                for j, w in enumerate(ws):
                    acc = accs[i * len(pw) + j]
                    builder.store(builder.call(dpbusd, [builder.load(acc), x, w]), acc)
        return [builder.load(acc) for acc in accs]

    def _lane_sums(builder, vecs: list) -> list:
        """The sum of each int32 vector's lanes as scalars, in vecs' order (see _lane_sums_vector)."""
        v, order = _lane_sums_vector(builder, vecs)
        out = [None] * len(order)
        for pos, k in enumerate(order):
            out[k] = builder.extract_element(v, ir.Constant(ir.IntType(32), pos))
        return out

    def _lane_sums_vector(builder, vecs: list):
        """The sum of each int32 vector's lanes (len(vecs) a power of two, all of one length L) -> (a vector of
        len(vecs) lanes, which vector's sum each lane holds): pairs of vectors fold their halves into one vector
        holding both (two shuffles and an add), down to one vector, which folds itself; ~3 instructions a pair
        instead of a reduction each (integer sums: any order, the same values). At most L vectors: each fold
        halves the lanes a vector's sum keeps."""
        vt = lambda n: ir.VectorType(ir.IntType(32), n)
        L, S = vecs[0].type.count, vecs[0].type.count
        assert len(vecs) <= L and len(vecs) & (len(vecs) - 1) == 0, "a power of two of vectors, at most their lanes"
        groups = [[k] for k in range(len(vecs))]  # which vectors' partial sums each vector holds, S lanes each
        while len(vecs) > 1:
            G = L // S
            lo = [g * S + i for g in range(G) for i in range(S // 2)]
            lo = lo + [L + x for x in lo]
            hi = [x + S // 2 for x in lo]
            pairs = range(0, len(vecs), 2)
            vecs = [builder.add(builder.shuffle_vector(vecs[a], vecs[a + 1], ir.Constant(vt(L), lo)),
                                builder.shuffle_vector(vecs[a], vecs[a + 1], ir.Constant(vt(L), hi))) for a in pairs]
            groups, S = [groups[a] + groups[a + 1] for a in pairs], S // 2
        v = vecs[0]
        while S > 1:
            lo = [g * S + i for g in range(v.type.count // S) for i in range(S // 2)]
            hi = [x + S // 2 for x in lo]
            v = builder.add(builder.shuffle_vector(v, v, ir.Constant(vt(len(lo)), lo)),
                            builder.shuffle_vector(v, v, ir.Constant(vt(len(lo)), hi)))
            S //= 2
        return v, groups[0]

    @intrinsic
    def dot_s8_avx2(typingctx, a, w, n32):
        """sum over k < n32 of int32(a[k]) * int32(w[k]) -> int32; a int8[K] with |a| <= 127, w int8[K], both
        1-D C-contiguous, n32 a multiple of 32 (the caller adds the tail). Exact for K < 2^31 / (128 * 127)."""
        if not _c_arrays(1, a, w) or not isinstance(n32, types.Integer):
            return None  # a typing error at compile time, never a wrong sum over a strided view

        def codegen(context, builder, sig, args):
            pa = context.make_array(sig.args[0])(context, builder, args[0]).data
            pw = context.make_array(sig.args[1])(context, builder, args[1]).data
            n = context.cast(builder, args[2], sig.args[2], types.int64)
            return _emit_dots(context, builder, [pa], [pw], n)[0]
        return types.int32(a, w, n32), codegen

    @intrinsic
    def dot4x2_s8_avx2(typingctx, a, w, m0, n0, n32):
        """The 8 sums over k < n32 of int32(a[m0 + i, k]) * int32(w[n0 + j, k]), i < 4, j < 2 -> int32 tuple in
        (i, j) order; a int8[M, K] with |a| <= 127, w int8[N, K], both 2-D C-contiguous; the caller keeps
        m0 + 3 < M, n0 + 1 < N and adds the K % 32 tail. A GEMM's register block: each 32 bytes loaded feed 2 or 4
        dot products (4 x 2: 8 accumulators, 2 |w|, a and a temporary in 16 ymm registers)."""
        if not _c_arrays(2, a, w) or not all(isinstance(t, types.Integer) for t in (m0, n0, n32)):
            return None

        return types.UniTuple(types.int32, 8)(a, w, m0, n0, n32), _block_codegen(_emit_dots, 4, 2)

if VNNI:
    @intrinsic
    def dot4x4_u8s8_vnni(typingctx, au, w, m0, n0, n64):
        """The 16 sums over k < n64 of int32(au[m0 + i, k]) * int32(w[n0 + j, k]), i < 4, j < 4 -> int32 tuple in
        (i, j) order; au uint8[M, K] (activations + 128), w int8[N, K], both 2-D C-contiguous; the caller keeps
        m0 + 3 < M, n0 + 3 < N, n64 a multiple of VNNI_STEP, and subtracts 128 * sum(w[n0 + j, :n64]) and adds the
        tail. A GEMM's register block with vpdpbusd: 16 zmm accumulators, 4 weight and 4 activation loads a step."""
        if not (_c_arrays(2, au, dtype=types.uint8) and _c_arrays(2, w)) \
                or not all(isinstance(t, types.Integer) for t in (m0, n0, n64)):
            return None

        return types.UniTuple(types.int32, 16)(au, w, m0, n0, n64), _block_codegen(_emit_dots_vnni, 4, 4)

    @intrinsic
    def gemm4x4_u8s8_vnni(typingctx, au, w, m0, n0, n64, off, o0, scale, y):
        """y[m0 + i, n0 + j] = float32(dot4x4_u8s8_vnni's sum (i, j) - off[o0 + j]) * scale[n0 + j] for i, j < 4,
        the block's epilogue in vectors (one subtract, convert and multiply for its 16 outputs, four 16-byte stores)
        where the scalar loop after dot4x4_u8s8_vnni spent ~a third of a 64-row GEMM: the same int32 sums, the same
        float32 rounding (sitofp, fmul), so the same bits. off int32[>= o0 + 4] (128 * sum(w[n]) a channel),
        scale float32[>= n0 + 4], y float32[M, N] C-contiguous; n64 the whole K (no tail), a multiple of VNNI_STEP."""
        if not (_c_arrays(2, au, dtype=types.uint8) and _c_arrays(2, w) and _c_arrays(1, off, dtype=types.int32)
                and _c_arrays(1, scale, dtype=types.float32) and _c_arrays(2, y, dtype=types.float32)) \
                or not all(isinstance(t, types.Integer) for t in (m0, n0, n64, o0)):
            return None

        def codegen(context, builder, sig, args):
            i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
            aa, ww, oo, ss, yy = (context.make_array(t)(context, builder, a)
                                  for t, a in zip((sig.args[0], sig.args[1], sig.args[5], sig.args[7], sig.args[8]),
                                                  (args[0], args[1], args[5], args[7], args[8])))
            m0, n0, n, o0 = (context.cast(builder, args[k], sig.args[k], types.int64) for k in (2, 3, 4, 6))
            accs = _emit_dot_vectors(context, builder, _rows(builder, aa, m0, 4), _rows(builder, ww, n0, 4), n)
            v, order = _lane_sums_vector(builder, accs)
            v16 = ir.VectorType(i32, 16)
            pos = {k: p for p, k in enumerate(order)}
            v = builder.shuffle_vector(v, v, ir.Constant(v16, [pos[k] for k in range(16)]))  # lane k = 4 i + j
            v4i, v4f = ir.VectorType(i32, 4), ir.VectorType(f32, 4)
            o4 = builder.load(builder.bitcast(builder.gep(oo.data, [o0]), v4i.as_pointer()), align=4)
            s4 = builder.load(builder.bitcast(builder.gep(ss.data, [n0]), v4f.as_pointer()), align=4)
            tile = ir.Constant(v16, [j for _ in range(4) for j in range(4)])
            offs = builder.shuffle_vector(o4, o4, tile)
            scales = builder.shuffle_vector(s4, s4, tile)
            outv = builder.fmul(builder.sitofp(builder.sub(v, offs), ir.VectorType(f32, 16)), scales)
            ystride = builder.extract_value(yy.strides, 0)
            ybase = builder.bitcast(yy.data, ir.IntType(8).as_pointer())
            for i in range(4):
                part = builder.shuffle_vector(outv, outv, ir.Constant(v4i, [4 * i + j for j in range(4)]))
                at = builder.gep(ybase, [builder.add(builder.mul(builder.add(m0, ir.Constant(i64, i)), ystride),
                                                     builder.mul(n0, ir.Constant(i64, 4)))])
                builder.store(part, builder.bitcast(at, v4f.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.none(au, w, m0, n0, n64, off, o0, scale, y), codegen

    @intrinsic
    def dot1x4_u8s8_vnni(typingctx, au, w, m0, n0, n64):
        """dot4x4_u8s8_vnni for one row of au: 4 sums. With au a row of ones, sum(w[n0 + j, :n64]) for j < 4 (the
        offset a + 128 puts into each sum), one vpdpbusd per 64 bytes of weights."""
        if not (_c_arrays(2, au, dtype=types.uint8) and _c_arrays(2, w)) \
                or not all(isinstance(t, types.Integer) for t in (m0, n0, n64)):
            return None
        return types.UniTuple(types.int32, 4)(au, w, m0, n0, n64), _block_codegen(_emit_dots_vnni, 1, 4)


# ---- the q4_0-tile GEMV's columns (kernels/f16_gemm.py): F16C rounds to FP16, FMA adds exact products ----------
F16C = AVX2 and _host_has("f16c", "fma")
Q4_PREFETCH = 64  # rows of codes ahead (16: 14.0, 32: 15.9, 64: 16.0, 128: 15.2 Gw/s on one core from DRAM)
# float lanes a vector of the q4 GEMV holds: 16 (a group's 16 columns, one zmm register) with AVX-512, else 8
Q4_LANES = 16 if F16C and _host_has("avx512f") and os.environ.get("EDGEPROBE_AVX512", "1") != "0" else 8

if F16C:
    def _q4_cols_codegen(groups: int, rows: int = 1):
        """The codegen of q4_*_f16 for `groups` groups of 16 columns and `rows` rows of x from m0 (the last argument
        where rows > 1): rows * groups * 16 / Q4_LANES <Q4_LANES x float> sums in registers over every row pair r of
        the codes, each r's 16 * groups code bytes read and dequantized once for all the rows."""
        L = Q4_LANES
        halves = 16 // L  # vectors a group of 16 columns takes

        def codegen(context, builder, sig, args):
            i8, i16, i32, i64, f32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType())
            vf, vh, vi, v16b = (ir.VectorType(f32, L), ir.VectorType(ir.HalfType(), L), ir.VectorType(i32, L),
                                ir.VectorType(i8, 16))
            xh, codes, d16, tab, out = (context.make_array(t)(context, builder, a)
                                        for t, a in zip(sig.args[:5], args[:5]))
            n, j, kh, *m0 = (context.cast(builder, v, t, types.int64) for v, t in zip(args[5:], sig.args[5:]))
            m0 = m0[0] if m0 else ir.Constant(i64, 0)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{L}f32")
            permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vi]),
                                                     "llvm.x86.avx512.permvar.sf.512") if L == 16 else None
            # a hint (read, keep, data): never faults, also past the array's end
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")
            byte = lambda arr: builder.bitcast(arr.data, i8.as_pointer())
            at = lambda base, off, ty: builder.bitcast(builder.gep(base, [off]), ty.as_pointer())
            c64 = lambda v: ir.Constant(i64, v)
            splat = lambda s: builder.shuffle_vector(builder.insert_element(ir.Constant(vf, ir.Undefined), s,
                                                                            ir.Constant(i32, 0)),
                                                     ir.Constant(vf, ir.Undefined), ir.Constant(vi, [0] * L))
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * L)) for _ in range(halves * groups)]
                    for _ in range(rows)]
            cstride = builder.extract_value(codes.strides, 0)
            dstride = builder.extract_value(d16.strides, 0)
            xrows = [builder.gep(byte(xh), [builder.mul(builder.add(m0, c64(m)), builder.extract_value(xh.strides, 0))])
                     for m in range(rows)]
            orows = [builder.gep(byte(out), [builder.add(builder.mul(builder.add(m0, c64(m)),
                                                                     builder.extract_value(out.strides, 0)),
                                                         builder.mul(j, c64(4)))]) for m in range(rows)]
            g0 = builder.sdiv(n, c64(16))
            lanes = [ir.Constant(ir.VectorType(i32, L), list(range(h * L, h * L + L))) for h in range(halves)]
            with cgutils.for_range(builder, kh) as loop:
                r = loop.index
                # x[m, 2r] (low nibbles), x[m, 2r + 1] (high) of each row
                xs = [[splat(builder.load(at(xr, builder.mul(builder.add(builder.mul(r, c64(2)), c64(p)), c64(4)),
                                             f32))) for p in (0, 1)] for xr in xrows]
                crow = builder.gep(byte(codes), [builder.add(builder.mul(r, cstride), n)])
                drow = builder.gep(byte(d16), [builder.mul(r, dstride)])
                # the codes and scales Q4_PREFETCH rows on: a pass walks down the rows with a stride of a row of
                # codes, which the hardware's prefetchers followed too late (1 core: 10.7 -> 16.0 Gw/s from DRAM)
                ahead = builder.mul(cstride, c64(Q4_PREFETCH))
                for addr in (builder.gep(crow, [ahead]), builder.gep(crow, [builder.add(ahead, c64(16 * groups - 1))]),
                             builder.gep(drow, [builder.add(builder.mul(dstride, c64(Q4_PREFETCH)),
                                                            builder.mul(g0, c64(2)))])):
                    builder.call(prefetch, [addr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
                for g in range(groups):
                    bits = builder.load(at(drow, builder.mul(builder.add(g0, c64(g)), c64(2)), i16), align=2)
                    if L == 16:  # the scale's 16 values fp16((q - 8) d): row `bits` of the table, vlut16's table
                        row = builder.load(at(byte(tab), builder.mul(builder.zext(bits, i64), c64(64)), vf), align=4)
                    else:
                        d = splat(builder.fpext(builder.bitcast(bits, ir.HalfType()), f32))
                        d8 = builder.fmul(d, ir.Constant(vf, [-8.0] * L))  # exact: a power of two times an FP16 value
                    cb = builder.load(at(crow, c64(16 * g), v16b), align=1)
                    if L == 16:  # the bytes widened once; vpermps reads an index's low 4 bits: no mask for k = 2r
                        wide = builder.zext(cb, vi)
                        nibs = (wide, builder.lshr(wide, ir.Constant(vi, [4] * L)))
                    else:
                        nibs = (builder.and_(cb, ir.Constant(v16b, [15] * 16)),
                                builder.lshr(cb, ir.Constant(v16b, [4] * 16)))
                    for h in range(halves):
                        ws = []
                        for p in (0, 1):
                            if L == 16:  # each code looks its value up (vpermps)
                                ws.append(builder.call(permute, [row, nibs[p]]))
                                continue
                            idx = builder.zext(builder.shuffle_vector(nibs[p], nibs[p], lanes[h]), vi)
                            w = builder.call(fma, [builder.sitofp(idx, vf), d, d8])  # (q - 8) d, exact in float32
                            ws.append(builder.fpext(builder.fptrunc(w, vh), vf))  # rounded to FP16, as vlut16's
                        for m in range(rows):
                            acc = accs[m][halves * g + h]
                            s = builder.load(acc)
                            for p in (0, 1):  # k = 2r, then 2r + 1: each sum in k order
                                s = builder.call(fma, [xs[m][p], ws[p], s])  # x w exact: one rounding, as mul + add
                            builder.store(s, acc)
            for m in range(rows):
                for k, acc in enumerate(accs[m]):
                    builder.store(builder.load(acc), at(orows[m], c64(4 * L * k), vf), align=4)
            return context.get_dummy_value()
        return codegen

    def _q4_cols_types(xh, codes, d16, tab, out, n, j, kh) -> bool:
        return (_c_arrays(2, xh, out, tab, dtype=types.float32) and _c_arrays(2, codes, dtype=types.uint8)
                and _c_arrays(2, d16, dtype=types.uint16) and all(isinstance(t, types.Integer) for t in (n, j, kh)))

    @intrinsic
    def q4_cols64_f16(typingctx, xh, codes, d16, tab, out, n, j, kh):
        """out[0, j:j + 64] = the sums over k < 2 kh of xh[0, k] * fp16((q[k, c] - 8) d) for the 64 columns c of
        codes n..n + 63 (4 groups), each in k order: xh float32[1, 2 kh] (FP16 values), codes uint8[Kh, Np] and d16
        uint16[Kh, Np / 16] as tiles.tiles_q4_rows lays them out, tab float32[65536, 16] f16_gemm.q4_table() (read
        with 16 lanes only), out float32[1, >= j + 64]; n a multiple of 16, every scale finite with |d| <=
        f16_gemm.D_MAX. The bits of f16_gemm's numba loop, Q4_LANES columns a vector."""
        if not _q4_cols_types(xh, codes, d16, tab, out, n, j, kh):
            return None
        return types.none(xh, codes, d16, tab, out, n, j, kh), _q4_cols_codegen(4)

    @intrinsic
    def q4_cols16_f16(typingctx, xh, codes, d16, tab, out, n, j, kh):
        """q4_cols64_f16 for one group: 16 columns."""
        if not _q4_cols_types(xh, codes, d16, tab, out, n, j, kh):
            return None
        return types.none(xh, codes, d16, tab, out, n, j, kh), _q4_cols_codegen(1)

    @intrinsic
    def q4_rows4_cols16_f16(typingctx, xh, codes, d16, tab, out, n, j, kh, m0):
        """q4_cols16_f16 for the 4 rows m0..m0 + 3 of xh into the same rows of out (a few decode candidates, the
        NPU TTS paper's batch): each code dequantized once for the 4 rows, Q4_LANES sums a register."""
        if not _q4_cols_types(xh, codes, d16, tab, out, n, j, kh) or not isinstance(m0, types.Integer):
            return None
        return types.none(xh, codes, d16, tab, out, n, j, kh, m0), _q4_cols_codegen(1, 4)
