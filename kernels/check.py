"""Every kernel of a backend against its numpy reference, on random and edge shapes and values.

`check(backend)` -> {"backend", "kernels": {name: {"cases", "bit_exact", "max_abs_err", "exact_required", "ok"}},
"ok"}. Integer kernels and the NPU-semantics ones must be bit-exact; float GEMMs (OpenCL) are held to a
tolerance, since their summation order is the driver's. Edge cases: K not a multiple of 128 (or of 4), M = 1,
int8 values -128 and 127, rounding ties, signed zeros, subnormal and overflowing scales, and every FP16 bit
pattern for the exp table. References are written independently of the kernels (float64 where that is exact).
"""
from __future__ import annotations

import numpy as np

from .f16_gemm import gemm_f16w_seq_ref
from .int8_gemm import gemm_s8s32_ref
from .lut import exp_table, lut16_dequant_ref
from .tiles import pack_superblocks, quantize_tiles, unpack_superblocks

BACKENDS = ("numba", "hvx", "opencl")


class BackendUnavailable(RuntimeError):
    """The backend's toolchain or device is missing (the message says how to install it)."""


# ---- references ------------------------------------------------------------------------------------

def quantize_ref(x: np.ndarray, scale) -> np.ndarray:
    """clip(rint(x / s), -127, 127) with the float32 quotient formed in float64 and rounded once (exact: 53 bits
    hold a 24-bit quotient's rounding), independent of numpy's float32 division."""
    q = (x.astype(np.float64) / np.float64(np.float32(scale))).astype(np.float32)
    return np.clip(np.rint(q), -127, 127).astype(np.int8)


def w8a8_ref(x, wt, scale_a, scale_w, smooth=None) -> np.ndarray:
    """run_w8a8 (and SmoothQuant's x / s first) written with the references: float32[M, N]."""
    if smooth is not None:
        x = (x.astype(np.float64) / smooth.astype(np.float64)).astype(np.float32)
    c = gemm_s8s32_ref(quantize_ref(x, scale_a), wt)
    return c.astype(np.float32) * np.float32(scale_a * scale_w)


def exp_ref(bits: np.ndarray) -> np.ndarray:
    """float16 exp(-|x|) from float64 for FP16 bit patterns; NaN patterns give 0 (the table's convention)."""
    v = np.abs(bits.view(np.float16).astype(np.float64))
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.exp(-v)
    out[np.isnan(v)] = 0.0
    return out.astype(np.float16)


# ---- cases ----------------------------------------------------------------------------------------------

GEMM_SHAPES = [(1, 1, 1), (1, 576, 192), (5, 33, 70), (4, 128, 32), (7, 130, 100), (3, 1030, 40)]
LINEAR_SHAPES = [(1, 64, 32), (5, 50, 70), (16, 576, 64), (9, 130, 33)]
TILE_SHAPES = [(32, 32), (64, 96), (50, 70)]


def gemm_cases(rng):
    for M, K, N in GEMM_SHAPES:
        a = rng.integers(-128, 128, (M, K), dtype=np.int8)
        b = rng.integers(-128, 128, (K, N), dtype=np.int8)
        a[0, : min(K, 3)] = [-128, 127, -128][: min(K, 3)]  # extremes: -128 * -128 and 127 * 127
        b[: min(K, 3), 0] = [-128, 127, 127][: min(K, 3)]
        if M > 1:
            a[1] = -128
            b[:, -1] = -128  # a whole row and column of -128: the largest sums
        yield a, b


def quantize_cases(rng):
    """(x float32[M, K], scale): random rows, exact ties n + 0.5, signed zeros, subnormals, inf, huge values."""
    for M, K, _ in LINEAR_SHAPES:
        for scale in (0.0371, 1.0, 3e-3, 1e-30, 7e5):
            x = (rng.standard_normal((M, K)) * 60 * scale).astype(np.float32)
            n = rng.integers(-130, 130, x.size).astype(np.float32)
            ties = ((n + 0.5) * np.float32(scale)).astype(np.float32).reshape(M, K)  # products near ties
            x[:, ::3] = ties[:, ::3]
            x.reshape(-1)[:6] = [0.0, -0.0, np.float32(1e-45), -np.inf, np.inf, np.float32(3e38)][: min(6, x.size)]
            yield x, scale


def tile_cases(rng):
    """Tile-group Q4_0 super-blocks: normal weights, an all-zero group, tiny (subnormal FP16 scales), huge."""
    for N, K in TILE_SHAPES:
        w = rng.standard_normal((N, K)).astype(np.float32)
        w[:2, :16] = 0.0
        yield quantize_tiles(w)
        yield quantize_tiles(w * np.float32(3e-7))  # FP16 scales in the subnormal range
        yield quantize_tiles(w * np.float32(6e4) / np.abs(w).max())  # products that round near the top
    G = 8 * 64  # any finite FP16 scale, either sign, with random codes: every rounding path of (j - 8) * d
    d = rng.integers(0, 0x7C00, G).astype(np.uint16) | (rng.integers(0, 2, G).astype(np.uint16) << 15)
    yield pack_superblocks(rng.integers(0, 16, (G, 32)).astype(np.uint8), d.view(np.float16))


# ---- the check ----------------------------------------------------------------------------------------

def _compare(name, results, exact_required=True, tol=0.0) -> dict:
    """results: (got, ref) pairs -> one row of the report."""
    exact, err = True, 0.0
    for got, ref in results:
        got, ref = np.asarray(got), np.asarray(ref)
        if got.shape != ref.shape:
            exact, err = False, float("inf")
            continue
        if got.dtype.kind == "f":
            same = np.array_equal(got.view(f"u{got.itemsize}"), ref.view(f"u{ref.itemsize}")) and got.dtype == ref.dtype
        else:
            same = np.array_equal(got, ref)
        exact &= bool(same)
        g, r = got.astype(np.float64), ref.astype(np.float64)
        finite = np.isfinite(g) & np.isfinite(r)
        d = np.abs(g[finite] - r[finite])
        if d.size:
            err = max(err, float(d.max()))
        if np.any(np.isfinite(g) != np.isfinite(r)):
            err = float("inf")
    ok = exact if exact_required else err <= tol
    return {"cases": len(results), "bit_exact": exact, "max_abs_err": err, "exact_required": exact_required, "ok": ok}


def _backend_kernels(backend: str):
    """name -> fn for each kernel the backend implements (the npu lane's kernels, the gpu lane's GEMMs)."""
    if backend == "numba":
        from .f16_gemm import gemm_f16w_seq
        from .int8_gemm import gemm_s8s32, gemm_s8s32_numba, quantize_per_tensor
        from .linear_records import run_smoothquant, run_w8a8
        from .lut import exp_lut, lut16_dequant

        def w8a8(x, wt, sa, sw, smooth=None):
            rec = {"wt": "w", "scale_a": sa, "scale_w": sw, "smooth": "s"}
            arrays = {"w": wt, "s": smooth}
            return (run_smoothquant if smooth is not None else run_w8a8)(rec, arrays.__getitem__, {})(x)

        def dequant(blocks):
            q, d = unpack_superblocks(blocks)
            return lut16_dequant(q, d).reshape(-1)

        return {"gemm_s8s32": gemm_s8s32, "gemm_s8s32_numba": gemm_s8s32_numba,
                "quantize_per_tensor": quantize_per_tensor, "w8a8_linear": w8a8, "q4_tile_dequant": dequant,
                "gemm_f16w_seq": lambda x, w16: gemm_f16w_seq(x, np.ascontiguousarray(w16.T, np.float32)),
                "exp_lut": lambda bits: exp_lut(bits.view(np.float16))}
    if backend == "hvx":
        from . import hvx_bridge

        why = hvx_bridge.unavailable_reason()
        if why:
            raise BackendUnavailable(why)
        dsp = hvx_bridge.shared()
        table = exp_table()
        return {"gemm_s8s32": dsp.gemm_s8s32, "quantize_per_tensor": dsp.quantize, "gemm_f16w_seq": dsp.gemm_f16w,
                "w8a8_linear": lambda x, wt, sa, sw, smooth=None: dsp.w8a8(x, wt, sa, sw, smooth),
                "q4_tile_dequant": dsp.q4_tile_dequant,
                "exp_lut": lambda bits: dsp.exp_lut(bits.view(np.float16), table)}
    if backend == "opencl":
        try:
            from .opencl_gemm import shared
            g = shared()
        except Exception as e:  # no pyopencl, no ICD, no device
            raise BackendUnavailable(f"the opencl backend needs pyopencl and an OpenCL device "
                                     f"({type(e).__name__}: {e}); Debian: apt-get install pocl-opencl-icd "
                                     "ocl-icd-libopencl1; pip install pyopencl") from None
        return {"gemm_s8s32": lambda a, b: g.gemm_s8s32(a, np.ascontiguousarray(b.T)),
                "gemm_f32": g.gemm_f32, "gemm_f16w": g.gemm_f16w}
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def check(backend: str, seed: int = 0) -> dict:
    """Run every kernel of `backend` on the cases above against the references. Raises BackendUnavailable."""
    kernels = _backend_kernels(backend)
    rng = np.random.default_rng(seed)
    out = {}
    for name in ("gemm_s8s32", "gemm_s8s32_numba"):
        if name in kernels:
            out[name] = _compare(name, [(kernels[name](a, b), gemm_s8s32_ref(a, b)) for a, b in gemm_cases(rng)])
    if "quantize_per_tensor" in kernels:
        with np.errstate(invalid="ignore", over="ignore"):
            out["quantize_per_tensor"] = _compare("quantize_per_tensor", [
                (kernels["quantize_per_tensor"](x, s), quantize_ref(x, s)) for x, s in quantize_cases(rng)])
    if "w8a8_linear" in kernels:
        res = []
        for M, K, N in LINEAR_SHAPES:
            x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
            wt = rng.integers(-127, 128, (K, N), dtype=np.int8)
            sa, sw = float(np.abs(x).max() / 127 * 0.7), 0.0123  # 0.7: some activations clip
            res.append((kernels["w8a8_linear"](x, wt, sa, sw), w8a8_ref(x, wt, sa, sw)))
            smooth = (rng.random(K) * 3 + 0.2).astype(np.float32)  # SmoothQuant: x / s per channel first
            res.append((kernels["w8a8_linear"](x, wt, sa, sw, smooth), w8a8_ref(x, wt, sa, sw, smooth)))
        out["w8a8_linear"] = _compare("w8a8_linear", res)
    if "q4_tile_dequant" in kernels:
        res = []
        for blocks in tile_cases(rng):
            q, d = unpack_superblocks(blocks)
            with np.errstate(over="ignore"):  # (j - 8) * d beyond 65504 is inf, in both
                res.append((kernels["q4_tile_dequant"](blocks), lut16_dequant_ref(q, d).reshape(-1)))
        out["q4_tile_dequant"] = _compare("q4_tile_dequant", res)
    if "exp_lut" in kernels:
        bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)  # every FP16 pattern: the whole range
        out["exp_lut"] = _compare("exp_lut", [(kernels["exp_lut"](bits), exp_ref(bits))])
    if "gemm_f16w_seq" in kernels:  # the W4A16 GEMM in k order: exact against that order's reference
        res = []
        for M, K, N in LINEAR_SHAPES[:3]:
            x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
            w = rng.standard_normal((N, K)).astype(np.float16)
            res.append((kernels["gemm_f16w_seq"](x, w), gemm_f16w_seq_ref(x, w)))
        out["gemm_f16w_seq"] = _compare("gemm_f16w_seq", res)
    for name, cast in (("gemm_f32", np.float32), ("gemm_f16w", np.float16)):
        if name in kernels:
            res = []
            for M, K, N in LINEAR_SHAPES:
                x = rng.standard_normal((M, K)).astype(np.float32)
                w = rng.standard_normal((N, K)).astype(cast)
                res.append((kernels[name](x, w), (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)))
            out[name] = _compare(name, res, exact_required=False, tol=1e-3)
    return {"backend": backend, "kernels": out, "ok": all(r["ok"] for r in out.values())}
