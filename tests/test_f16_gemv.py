"""The npu lane's q4_0-tile GEMV from 4-bit codes (kernels/f16_gemm.py gemv_q4_seq): the bits of the k-ordered
W4A16 GEMM on the dequantized weight, for every FP16 scale, edge shapes and the runner's both paths."""
import os

import numpy as np
import pytest

from edgeprobe_kernels import f16_gemm
from edgeprobe_kernels.f16_gemm import gemm_f16w_seq, gemm_f16w_seq_ref, gemv_q4_seq, q4_rows_exact, q4_rows_t
from edgeprobe_kernels.linear_records import NPU_RUNNERS
from edgeprobe_kernels.tiles import dequantize_tiles_t, pack_superblocks, quantize_tiles, tiles_q4_rows

rng = np.random.default_rng(42)


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _every_scale_weight(limit=f16_gemm.D_MAX):
    """A [32, K] weight whose groups hold every finite FP16 scale with |d| <= limit, each with every code."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    d = bits.view(np.float16)
    scales = bits[np.isfinite(d) & (np.abs(d.astype(np.float32)) <= limit)]
    scales = np.resize(scales, -(-len(scales) // 32) * 32).view(np.float16)
    q = np.tile(np.arange(32, dtype=np.uint8) % 16, (len(scales), 1))
    return pack_superblocks(q, scales), 32, len(scales)  # 32 groups per 32 values of k: K = number of groups


def test_row_layout_dequantizes_every_fp16_scale_as_the_tiles_do():
    blocks, N, K = _every_scale_weight()
    codes, d16 = tiles_q4_rows(blocks, N, K)
    assert codes.shape == (K // 2, N) and d16.shape == (K // 2, N // 16) and q4_rows_exact(d16)
    np.testing.assert_array_equal(_bits(q4_rows_t(codes, d16, N, K)), _bits(dequantize_tiles_t(blocks, N, K)))


def test_gemv_every_fp16_scale_bit_exact():
    blocks, N, K = _every_scale_weight()
    codes, d16 = tiles_q4_rows(blocks, N, K)
    wt = dequantize_tiles_t(blocks, N, K)
    for M in (1, 2, 4, 7, 16):  # one row; blocks of 4 rows (simd.q4_rows4_cols16_f16 where the CPU has F16C)
        x = (rng.standard_normal((M, K)) * rng.choice([1e-6, 1.0, 100.0], (M, K))).astype(np.float32)
        np.testing.assert_array_equal(_bits(gemv_q4_seq(x, codes, d16, N, K)), _bits(gemm_f16w_seq(x, wt)))


def test_the_other_vector_width_gives_the_same_bits(tmp_path):
    """The SIMD columns run 16 lanes and a vpermps table a group where the CPU has AVX-512, 8 lanes with F16C's
    rounding per weight where it has AVX2 only (simd.Q4_LANES). The width this process did not take, in a process
    of its own (EDGEPROBE_AVX512 picks it; its own numba cache, which is keyed by the source, not the setting), over
    every FP16 scale with every code, one row and blocks of 4 rows: the same bits as this process's GEMV."""
    import subprocess
    import sys

    from edgeprobe_kernels import simd

    if not simd.F16C:
        pytest.skip("this CPU has no F16C: the GEMV runs the numba loop (the test above), no SIMD columns")
    blocks, N, K = _every_scale_weight()
    codes, d16 = tiles_q4_rows(blocks, N, K)
    x = (rng.standard_normal((5, K)) * rng.choice([1e-6, 1.0, 100.0], (5, K))).astype(np.float32)
    np.save(tmp_path / "codes.npy", codes)
    np.save(tmp_path / "d16.npy", d16)
    np.save(tmp_path / "x.npy", x)
    other = "0" if simd.Q4_LANES == 16 else "1"
    code = ("import sys, numpy as np\n"
            "from edgeprobe_kernels import simd\n"
            "from edgeprobe_kernels.f16_gemm import gemv_q4_seq\n"
            "d = sys.argv[1]\n"
            "c, s, x = (np.load(f'{d}/{n}.npy') for n in ('codes', 'd16', 'x'))\n"
            f"np.save(f'{{d}}/y1.npy', gemv_q4_seq(x[:1], c, s, {N}, {K}))\n"
            f"np.save(f'{{d}}/y5.npy', gemv_q4_seq(x, c, s, {N}, {K}))\n"
            "print(simd.Q4_LANES)")
    env = dict(os.environ, EDGEPROBE_AVX512=other, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) == (8 if simd.Q4_LANES == 16 or not _has_avx512() else 16)
    np.testing.assert_array_equal(_bits(np.load(tmp_path / "y1.npy")), _bits(gemv_q4_seq(x[:1], codes, d16, N, K)))
    np.testing.assert_array_equal(_bits(np.load(tmp_path / "y5.npy")), _bits(gemv_q4_seq(x, codes, d16, N, K)))


def _has_avx512() -> bool:
    import platform

    return platform.machine() in ("x86_64", "AMD64") and " avx512f" in open("/proc/cpuinfo").read()


@pytest.mark.parametrize("M", [1, 3, 4, 8])
def test_the_numba_loop_of_cpus_without_f16c_gives_the_same_bits(M):
    """The GEMV's numba loop (f16_gemm._gemv_q4_loop: the path of a CPU without F16C, which an F16C machine never
    takes through gemv_q4_seq) called directly, over every FP16 scale with every code."""
    from edgeprobe_kernels.lut import _f16_values

    blocks, N, K = _every_scale_weight()
    codes, d16 = tiles_q4_rows(blocks, N, K)
    Kh = codes.shape[0]
    x = (rng.standard_normal((M, K)) * rng.choice([1e-6, 1.0, 100.0], (M, K))).astype(np.float32)
    xh = np.zeros((M if M == 1 else -(-M // 4) * 4, 2 * Kh), np.float32)
    xh[:M, :K] = x.astype(np.float16)
    acc = np.zeros((xh.shape[0], N), np.float32)
    f16_gemm._gemv_q4_loop(xh, codes, d16, _f16_values(), acc, M, 0, N)
    np.testing.assert_array_equal(_bits(acc[:M]), _bits(gemm_f16w_seq(x, dequantize_tiles_t(blocks, N, K))))


SHAPES = [(1, 1), (17, 1), (16, 31), (33, 33), (50, 70), (40, 64), (576, 576), (192, 576), (576, 1536), (2100, 96)]


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 9, 16])
def test_gemv_equals_the_k_ordered_gemm_bit_for_bit(N, K, M):
    w = (rng.standard_normal((N, K)) * rng.choice([1e-3, 1.0, 30.0], (N, 1))).astype(np.float32)
    blocks = quantize_tiles(w)
    codes, d16 = tiles_q4_rows(blocks, N, K)
    wt = dequantize_tiles_t(blocks, N, K)
    x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
    y = gemv_q4_seq(x, codes, d16, N, K)
    assert y.shape == (M, N) and y.dtype == np.float32
    np.testing.assert_array_equal(_bits(y), _bits(gemm_f16w_seq(x, wt)))
    if N * K <= 200_000:  # the numpy definition, one k at a time
        np.testing.assert_array_equal(_bits(y), _bits(gemm_f16w_seq_ref(x, wt.T.astype(np.float16))))


def test_gemv_special_activations_bit_exact():
    # FP16 overflow of x (inf), inf, NaN, zeros of both signs and FP16 subnormals: the same bits, NaNs included
    N, K = 64, 96
    blocks = quantize_tiles(rng.standard_normal((N, K)).astype(np.float32))
    codes, d16 = tiles_q4_rows(blocks, N, K)
    wt = dequantize_tiles_t(blocks, N, K)
    x = rng.standard_normal((4, K)).astype(np.float32)
    x[0, 5], x[1, 7], x[2, 9], x[3, :8] = 1e6, -np.inf, np.nan, [0.0, -0.0, 3e-8, -3e-8, 6e-5, 1e-9, 65504, -65520]
    with np.errstate(over="ignore"):  # 1e6 and -65520 round to infinite FP16 on both sides
        np.testing.assert_array_equal(_bits(gemv_q4_seq(x, codes, d16, N, K)), _bits(gemm_f16w_seq(x, wt)))


def test_gemv_thread_counts_give_the_same_bits():
    import numba  # a dependency of the project: never skipped for a missing install
    N, K = 2000, 160  # past GEMV_ALONE: one thread runs it alone, more start a parallel region
    assert N * K >= f16_gemm.GEMV_ALONE
    blocks = quantize_tiles(rng.standard_normal((N, K)).astype(np.float32))
    codes, d16 = tiles_q4_rows(blocks, N, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = gemv_q4_seq(x, codes, d16, N, K)
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_array_equal(_bits(one), _bits(gemv_q4_seq(x, codes, d16, N, K)))


def test_gemv_refuses_a_wrong_shape():
    blocks = quantize_tiles(rng.standard_normal((32, 64)).astype(np.float32))
    codes, d16 = tiles_q4_rows(blocks, 32, 64)
    with pytest.raises(ValueError, match="gemv_q4_seq"):
        gemv_q4_seq(np.ones((1, 63), np.float32), codes, d16, 32, 64)
    with pytest.raises(ValueError, match="super-blocks"):
        tiles_q4_rows(blocks[:-1], 32, 64)


@pytest.mark.parametrize("scale", [1.0, 3e-7, "huge"])
@pytest.mark.parametrize("M", [1, 3, 4, 5, 9, 16, 17])
def test_npu_runner_is_the_k_ordered_gemm_on_either_path(scale, M):
    # the runner's GEMV (M <= GEMV_M), its per-call dequantization (more rows) and its float32 fallback for
    # scales past D_MAX all give gemm_f16w_seq's bits on the tile dequantizer's weight
    N, K = 96, 80
    w = rng.standard_normal((N, K)).astype(np.float32)
    w = w * np.float32(6e4) / np.abs(w).max() if scale == "huge" else w * np.float32(scale)
    blocks = quantize_tiles(w)
    assert q4_rows_exact(tiles_q4_rows(blocks, N, K)[1]) == (scale != "huge")
    rec = {"scheme": "q4_0-tile", "shape": [N, K], "blocks": "b"}
    run = NPU_RUNNERS["q4_0-tile"](rec, {"b": blocks}.__getitem__, {})
    x = rng.standard_normal((M, K)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = gemm_f16w_seq(x, dequantize_tiles_t(blocks, N, K))
        np.testing.assert_array_equal(_bits(run(x, counters={})), _bits(ref))


@pytest.mark.usefixtures("hvx_toolchain")
def test_gemv_path_is_bit_exact_with_the_hexagon_kernel():
    """Decode rows (the GEMV from codes) and prefill rows against the DSP's W4A16 GEMM (kernels/hvx/gemm_f16.c)."""
    from edgeprobe.quant.blobs import BlobStore
    from edgeprobe.quant.schemes import build_q4_0_tile
    from edgeprobe_kernels import hvx_bridge, hvx_linear

    store = BlobStore()
    rec = build_q4_0_tile("blk.0.ffn_up", rng.standard_normal((70, 130)).astype(np.float32), {}, store)
    run = NPU_RUNNERS["q4_0-tile"](rec, store.get, {})
    dsp = hvx_bridge.HvxDsp(arena_mb=64, scratch_mb=16, timeout_s=60).start()
    try:
        hvx = hvx_linear.runner(rec, "all", store.get, dsp=dsp)
        for M in (1, 4, 5, 16, 17):
            x = (rng.standard_normal((M, 130)) * 4).astype(np.float32)
            np.testing.assert_array_equal(_bits(run(x, counters={})), _bits(hvx(x)))
    finally:
        dsp.close()
