"""NPU-semantics kernels against their numpy references (exact where the arithmetic is integer)."""
import gguf
import numpy as np
import pytest

from edgeprobe_kernels.flash_attention import flash_attention_f16, flash_attention_f16_ref
from edgeprobe_kernels.int8_gemm import EXACT_K, gemm_s8s32, gemm_s8s32_numba, gemm_s8s32_ref, quantize_per_tensor
from edgeprobe_kernels.lut import exp_lut, exp_lut_max_error, lut16_dequant, lut16_dequant_ref, q4_quantize_groups
from edgeprobe_kernels.shadow import extract_outliers, shadow_gemm, shadow_gemm_ref
from edgeprobe_kernels.tiles import (
    SUPER_BYTES,
    dequantize_tiles,
    dequantize_tiles_t,
    from_tiles,
    pack_superblocks,
    quantize_tiles,
    to_tiles,
    unpack_superblocks,
)

rng = np.random.default_rng(0)


@pytest.mark.parametrize("fn", [gemm_s8s32, gemm_s8s32_numba])
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (5, 33, 7), (64, 576, 192), (9, 1536, 40), (3, 3 * EXACT_K + 5, 4)])
def test_int8_gemm_exact(M, K, N, fn):
    a = rng.integers(-127, 128, (M, K), dtype=np.int8)
    bt = rng.integers(-127, 128, (K, N), dtype=np.int8)
    a[0] = 127  # extremes: int16 products, int32 sums and float32 K-block sums (2^24) must all stay exact
    bt[:, 0] = -127
    bt[:, 1:2] = 127
    np.testing.assert_array_equal(fn(a, bt), gemm_s8s32_ref(a, bt))
    assert fn(a, bt)[0, 0] == -127 * 127 * K
    if N > 1:
        assert fn(a, bt)[0, 1] == 127 * 127 * K
    with pytest.raises(ValueError, match="int8"):
        fn(a.astype(np.int16), bt)


def test_quantize_per_tensor_symmetric():
    x = np.array([-3.0, -0.26, 0.0, 0.25, 2.0, 100.0], np.float32)
    np.testing.assert_array_equal(quantize_per_tensor(x, 0.5), [-6, -1, 0, 0, 4, 127])


def test_q4_groups_match_ggml_and_lut_is_bit_exact():
    x = rng.standard_normal((500, 32)).astype(np.float32)
    q, d = q4_quantize_groups(x)
    blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0).reshape(-1, 18)
    np.testing.assert_array_equal(d.view(np.uint16), blocks[:, :2].copy().view("<u2").reshape(-1))
    nib = blocks[:, 2:]
    np.testing.assert_array_equal(q, np.concatenate([nib & 15, nib >> 4], axis=1))
    a, b = lut16_dequant_ref(q, d), lut16_dequant(q, d)
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    # the table holds (i - 8) * d rounded to FP16
    np.testing.assert_array_equal(a, ((q.astype(np.float32) - 8) * d.astype(np.float32)[:, None]).astype(np.float16))


def test_exp_table():
    x = -np.abs(rng.standard_normal(10000) * 5).astype(np.float16)
    got = exp_lut(x).astype(np.float64)
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=1e-3, atol=1e-7)
    err = exp_lut_max_error()
    assert err["max_rel_error_normal"] <= 2 ** -11 and err["entries"] == 32768
    assert exp_lut(np.float16(0.0)) == 1.0 and exp_lut(np.float16(-np.inf)) == 0.0


@pytest.mark.parametrize("N,K", [(32, 32), (64, 96), (50, 70), (192, 576)])
def test_tile_layout_round_trip_and_byte_layout(N, K):
    w = rng.standard_normal((N, K)).astype(np.float32)
    np.testing.assert_array_equal(from_tiles(to_tiles(w), N, K), w)
    blocks = quantize_tiles(w)
    Kp, Np = -(-K // 32) * 32, -(-N // 32) * 32
    assert blocks.shape == (Kp * Np // 256, SUPER_BYTES)
    q, d = unpack_superblocks(blocks)
    np.testing.assert_array_equal(pack_superblocks(q, d), blocks)
    wq = dequantize_tiles(blocks, N, K).astype(np.float32)
    # Q4_0 rounds to half a step, except the clamp at 15 on the side opposite the largest value: one step
    err = np.abs(to_tiles(wq) - to_tiles(w)).reshape(-1, 32).max(axis=1)
    assert np.all(err <= np.abs(d.astype(np.float32)) * 1.001 + 1e-3)



@pytest.mark.parametrize("N,K", [(32, 32), (50, 70), (192, 576)])
def test_kmajor_dequantization_equals_the_tile_path_bit_for_bit(N, K):
    w = rng.standard_normal((N, K)).astype(np.float32)
    blocks = quantize_tiles(w)
    wt = dequantize_tiles_t(blocks, N, K)
    assert wt.shape == (K, N) and wt.dtype == np.float32
    np.testing.assert_array_equal(wt.view(np.uint32), np.ascontiguousarray(dequantize_tiles(blocks, N, K).T,
                                                                             np.float32).view(np.uint32))
    with pytest.raises(ValueError, match="super-blocks"):
        dequantize_tiles_t(blocks[:-1], N, K)


def test_kmajor_dequantization_rounds_every_fp16_scale_as_the_table_does():
    # tiny (subnormal products), huge (overflow to inf) and ordinary scales: the fast rounding and the slow one
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    scales = bits[np.isfinite(bits.view(np.float16))]
    scales = np.resize(scales, -(-len(scales) // 32) * 32).view(np.float16)
    q = np.tile(np.arange(32, dtype=np.uint8) % 16, (len(scales), 1))  # every code in every group
    blocks = pack_superblocks(q, scales)
    N, K = 32, len(scales)  # 32 groups (one tile column of 32 k) per 32 values of n: K = number of groups
    wt = dequantize_tiles_t(blocks, N, K)
    ref = np.ascontiguousarray(dequantize_tiles(blocks, N, K).T, np.float32)
    np.testing.assert_array_equal(wt.view(np.uint32), ref.view(np.uint32))

def test_tile_order_is_hmx_order():
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # W[n, k] = 64 n + k
    s = to_tiles(w)
    # tile 0 = (k 0..31, n 0..31): rows k=0 and k=1 interleave column by column
    np.testing.assert_array_equal(s[:4], [w[0, 0], w[0, 1], w[1, 0], w[1, 1]])
    assert s[1024] == w[0, 32]  # tiles are column-major: the next tile goes down K
    assert s[2048] == w[32, 0]  # after all K tiles, the next column of tiles
    # super-block nibble layout: byte 16+b holds value b (low) and value b+128 (high)
    blocks = quantize_tiles(w)
    q, _ = unpack_superblocks(blocks)
    first = q[:8].reshape(-1)
    assert blocks[0, 16] == first[0] | (first[128] << 4)


def test_shadow_gemm():
    x = (rng.standard_normal((20, 48)) * 2).astype(np.float32)
    w = rng.standard_normal((30, 48)).astype(np.float32)
    rows, cols, vals = extract_outliers(x, 2.5)
    hot = np.array([3, 10, 11])
    cold = np.setdiff1d(np.arange(48), hot)
    slot = np.empty(48, np.int64)
    slot[hot], slot[cold] = np.arange(3), -1 - np.arange(len(cold))
    y1, y2 = np.zeros((20, 30), np.float32), np.zeros((20, 30), np.float32)
    shadow_gemm_ref(rows, cols, vals, slot, w.T[hot].copy(), w.T[cold].copy(), y1)
    shadow_gemm(rows, cols, vals, slot, w.T[hot].copy(), w.T[cold].copy(), y2)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_allclose(y1, (x - np.clip(x, -2.5, 2.5)) @ w.T, atol=1e-5)


@pytest.mark.parametrize("M", [1, 3, 16, 70])
def test_the_one_pass_shadow_delta_is_the_numpy_paths_bits_and_counts(M):
    """shadow_delta_onepass (one numba pass, decode rows and prefill chunks) against extract_outliers + shadow_gemm:
    values exactly at and one ulp past a clip that float32 cannot hold, and a cold channel that two rows both read
    (counted once)."""
    from edgeprobe_kernels.linear_records import shadow_delta

    K, N, clip = 48, 30, 2.2  # float32(2.2) > 2.2: x == float32(clip) is an outlier only if compared in float64
    x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
    c32 = np.float32(clip)
    x[0, 5], x[0, 6], x[0, 7] = c32, np.nextafter(c32, np.float32(9)), -np.nextafter(c32, np.float32(9))
    x[:, 20] = 5.0  # channel 20 is cold: every row reads it
    w = rng.standard_normal((N, K)).astype(np.float32)
    hot = np.array([3, 6, 11])
    cold = np.setdiff1d(np.arange(K), hot)
    slot = np.empty(K, np.int64)
    slot[hot], slot[cold] = np.arange(3), -1 - np.arange(len(cold))
    blobs = {"slot": slot, "hot": w.T[hot].copy(), "cold": w.T[cold].copy()}
    rec = {"shape": [N, K], "shadow": True, "clip": clip, "slot": "slot", "hot": "hot", "cold": "cold"}
    fast_c = {}
    fast = shadow_delta(rec, blobs.__getitem__, fast_c)(x)
    rows, cols, vals = extract_outliers(x, clip)
    slow = np.zeros((M, N), np.float32)
    shadow_gemm(rows, cols, vals, slot, blobs["hot"], blobs["cold"], slow)
    np.testing.assert_array_equal(fast, slow)
    cold_read = np.unique(cols[slot[cols] < 0])
    assert fast_c == {"shadow_values": x.size, "outliers": len(rows), "cold_rows_read": len(cold_read),
                      "cold_bytes_read": len(cold_read) * N * 4}
    assert 6 in cols[rows == 0] and (cols == 20).sum() == M


@pytest.mark.parametrize("causal,start", [(True, 0), (True, 5), (False, 0)])
def test_flash_attention_f16(causal, start):
    H, T, d = 2, 40, 64
    S = start + T if causal else 50
    q = rng.standard_normal((H, T, d)).astype(np.float32)
    k = rng.standard_normal((H, S, d)).astype(np.float32)
    v = rng.standard_normal((H, S, d)).astype(np.float32)
    s = np.einsum("htd,hsd->hts", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(d)
    if causal:
        s[:, np.arange(S)[None, :] > (start + np.arange(T))[:, None]] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
    a = flash_attention_f16_ref(q, k, v, causal, start)
    b = flash_attention_f16(q, k, v, causal, start)
    assert np.abs(a - ref).max() < 1e-2 and np.abs(b - ref).max() < 1e-2
    assert np.abs(a - b).max() < 2e-3


@pytest.mark.parametrize("batch", [1, 9, 16])
def test_a_batch_of_decode_steps_takes_the_decode_kernel_and_each_sequence_its_own_bits(batch, monkeypatch):
    """One query row per sequence (a batched decode step, the NPU TTS paper's N candidates) takes the decode kernel
    at any batch size, never the prompt's blocks (ATTN_BLOCK query rows computed for each sequence's one), and each
    sequence's row is the one it gets decoded alone."""
    from edgeprobe_kernels import llama_ops

    def no_blocks(*a, **k):
        raise AssertionError("a decode step took the prompt's attention blocks")

    monkeypatch.setattr(llama_ops, "_attention_block", no_blocks)
    rng = np.random.default_rng(batch)
    H, KV, d, start = 9, 3, 64, 70
    q = rng.standard_normal((batch, 1, H, d)).astype(np.float32)
    k, v = (rng.standard_normal((batch, KV, start + 30, d)).astype(np.float32) for _ in range(2))
    out = llama_ops.attention(q, k, v, start)
    for b in range(batch):
        alone = llama_ops.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], start)
        assert np.array_equal(out[b], alone[0]), b


def test_the_decode_softmaxs_exp_is_within_an_ulp_of_numpys_with_or_without_fastmath():
    """llama_ops.exp_f64 (the decode attention's exp, vectorized where numba's np.exp is a scalar call): within
    1 ulp of numpy's float64 exp over the softmax's range and beyond, 0 below -708, NaN kept, and the same bits
    in a fastmath loop as in a strict one (a reassociated reduction was 200 ulp off at x = -700)."""
    import numba

    from edgeprobe_kernels.llama_ops import exp_f64

    def loop(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_f64(x[i])
    strict, fast = numba.njit(loop), numba.njit(fastmath=True)(loop)
    x = np.concatenate([np.linspace(-708.0, 709.0, 1_000_001), -np.abs(rng.standard_normal(100_000)) * 20,
                        [0.0, -0.0, -1e-300, 1e-300, -708.0]])
    a, b = np.empty_like(x), np.empty_like(x)
    strict(x, a)
    fast(x, b)
    assert np.array_equal(a, b)
    ref = np.exp(x)
    assert (np.abs(a - ref) <= np.spacing(ref)).all()
    assert a[-5] == a[-4] == 1.0 and a[-1] > 0
    edge = np.array([-708.01, -745.2, -np.inf, np.nan])
    out = np.empty_like(edge)
    strict(edge, out)
    assert (out[:3] == 0).all() and np.isnan(out[3])


def test_the_decode_attention_kernel_is_the_numpy_paths_bits():
    """A decode step's attention in numba (llama_ops._attention_few_nb, vectorized exp) and in numpy (an agent
    without numba: _attention_few_np, np.exp) round the same float64 softmax to float32: equal bits here, where the
    scores span the exp's range (a scale of 40 puts most keys' weights below 1e-100)."""
    from edgeprobe_kernels import llama_ops as L

    rng = np.random.default_rng(5)
    for batch, T, start, scale in [(1, 1, 99, 0.0), (2, 3, 300, 0.0), (1, 1, 40, 40.0), (3, 2, 7, 0.0)]:
        q = rng.standard_normal((batch, T, 9, 64)).astype(np.float32) * 2
        k, v = (rng.standard_normal((batch, 3, start + T + 5, 64)).astype(np.float32) for _ in range(2))
        fast = L.attention(q, k, v, start, scale=scale)
        slow = L._attention_few_np(q, k, v, start, 0, L._scale64(64, scale))
        assert np.array_equal(fast, slow), (batch, T, start, scale)


@pytest.mark.parametrize("T,start,window,softcap", [(64, 0, 0, 0.0), (100, 37, 0, 0.0), (300, 0, 40, 0.0),
                                                    (200, 10, 0, 30.0)])
def test_a_prompt_blocks_softmax_in_numba_is_numpys_bit_for_bit(T, start, window, softcap, monkeypatch):
    """_attention_block's softmax in numba (mask and max-subtract, numpy's exp, row sums in numpy's pairwise order,
    divide) against the numpy expressions an agent without numba runs: equal bits, windowed and soft-capped too;
    and the pairwise sum is numpy's add.reduce at lengths around its block of 128 and its halving splits."""
    from edgeprobe_kernels import llama_ops as L

    rng = np.random.default_rng(T)
    q = rng.standard_normal((1, T, 9, 64)).astype(np.float32) * 3
    k, v = (rng.standard_normal((1, 3, start + T + 9, 64)).astype(np.float32) for _ in range(2))
    fast = L.attention(q, k, v, start, window, softcap=softcap)
    monkeypatch.setattr(L, "numba", None)
    assert np.array_equal(fast, L.attention(q, k, v, start, window, softcap=softcap))
    for n in (1, 7, 8, 13, 64, 128, 129, 136, 192, 1000, 1024, 4099):
        a = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 3)).astype(np.float32)  # order shows in bits
        assert L._pairwise_sum_nb(a, n, np.empty((64, 3), np.int64), np.empty(64, np.float32)) == a.sum(), n


@pytest.mark.parametrize("T,chunk,window", [(32, 16, 0), (210, 64, 0), (300, 48, 40), (530, 128, 0)])
def test_attention_gives_a_chunked_prompt_the_whole_passs_bits(T, chunk, window):
    """Prefill attention's query blocks sit at absolute positions (llama_ops._attention_block): a schedule's cut
    never changes a row's last bit, which per-tensor int8 downstream would turn into a whole code step. Checked
    against float64 too, and with a KV cache longer than the prompt whose tail holds garbage (nan). (A chunk of
    <= FEW_ROWS rows is computed by the decode kernel, in float64: none here.)"""
    from edgeprobe_kernels.llama_ops import attention

    rng = np.random.default_rng(T + chunk)
    H, KV, d = 9, 3, 64
    q = rng.standard_normal((1, T, H, d)).astype(np.float32)
    k, v = (np.full((1, KV, T + 70, d), np.nan, np.float32) for _ in range(2))
    k[:, :, :T], v[:, :, :T] = (rng.standard_normal((1, KV, T, d)).astype(np.float32) for _ in range(2))
    whole = attention(q, k, v, 0, window)
    for s0 in range(0, T, chunk):
        s1 = min(T, s0 + chunk)
        assert np.array_equal(attention(q[:, s0:s1], k, v, s0, window), whole[s0:s1]), s0
    g = np.repeat(np.arange(KV), H // KV)  # float64, written out: causal (and windowed) softmax(q k^T / sqrt(d)) v
    sc = np.einsum("thd,hsd->hts", q[0].astype(np.float64), k[0, g, :T].astype(np.float64)) / np.sqrt(d)
    pos, keys = np.arange(T)[:, None], np.arange(T)[None, :]
    sc[:, (keys > pos) | ((keys <= pos - window) if window else False)] = -np.inf
    p = np.exp(sc - sc.max(-1, keepdims=True))
    ref = np.einsum("hts,hsd->thd", p / p.sum(-1, keepdims=True), v[0, g, :T].astype(np.float64)).reshape(T, -1)
    assert np.abs(whole - ref).max() < 1e-5
