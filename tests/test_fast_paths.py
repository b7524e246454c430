"""Issue 17's fast paths compute what the paths they replace compute: the int8 GEMV (exact, bit for bit), the
exact-float BLAS path of w8a8 linears, the Q8_0 LM head (lossless on SmolLM2's own Q8_0 head, its decode
kernel and BLAS path agreeing), a decode step's fused layers (the same logits as the unfused ops), and a fused op
the agent refuses before running when it is malformed."""
import os
import threading

import numpy as np
import pytest
from test_graph import step_after_prompt, toy_model

from edgeprobe.graph.place import fuse_layers
from edgeprobe.plan import prefill_plan
from edgeprobe.quant import calibration_profile, quantize
from edgeprobe_agent.executor import validate
from edgeprobe_agent.protocol import AgentError
from edgeprobe_kernels import int8_gemm
from edgeprobe_kernels.int8_gemm import gemm_s8s32_ref, gemv_s8s32, quantize_per_tensor
from edgeprobe_kernels.linear_records import run_w8a8
from edgeprobe_kernels.q8_0 import dequantize_q8_0, matmul_q8_0, quantize_q8_0


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("K,N", [(576, 192), (1536, 576), (70, 33)])
def test_int8_gemv_is_exact(M, K, N):
    rng = np.random.default_rng(K + N + M)
    a = rng.integers(-127, 128, (M, K), dtype=np.int8)
    w = rng.integers(-127, 128, (N, K), dtype=np.int8)
    assert np.array_equal(gemv_s8s32(a, w), gemm_s8s32_ref(a, np.ascontiguousarray(w.T)))
    full = np.full((M, K), 127, np.int8)  # the largest sums: still exact in int32
    assert np.array_equal(gemv_s8s32(full, np.full((N, K), -127, np.int8)), np.full((M, N), -127 * 127 * K))


@pytest.mark.parametrize("gemm_int8", [False, True] if int8_gemm.GEMM_INT8 else [False])
@pytest.mark.parametrize("K", [576, 1536])
def test_every_w8a8_path_gives_the_same_bits(K, gemm_int8, monkeypatch):
    """Decode rows (GEMV), few and many rows (AVX2 int8 GEMM, or exact float BLAS, K <= 1024; int32 blocks above):
    one answer."""
    monkeypatch.setattr(int8_gemm, "GEMM_INT8", gemm_int8)
    rng = np.random.default_rng(K)
    wt = rng.integers(-127, 128, (K, 300), dtype=np.int8)
    sw_ch = (rng.random(300) * 0.01 + 0.001).astype(np.float32)  # w8a8c: the weight's scale per output channel
    blobs = {"w": wt, "ch": sw_ch}
    for rec, scale in (({"wt": "w", "scale_a": 0.031, "scale_w": 0.007}, np.float32(0.031 * 0.007)),
                       ({"wt": "w", "scale_a": 0.031, "scale_w_ch": "ch"}, np.float32(0.031) * sw_ch)):
        agent = run_w8a8(rec, blobs.get, None, keep_f32=True)
        host = run_w8a8(rec, blobs.get, None)
        for M in (1, 7, 20, 64, 257):
            x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
            x[0, :40] = (np.arange(40, dtype=np.float32) - 20.5) * np.float32(0.031)  # halves: rint rounds to even
            x[0, 40:44] = [1e3, -1e3, 4.0, -4.0]  # clipped at +-127
            ref = gemm_s8s32_ref(quantize_per_tensor(x, 0.031), wt).astype(np.float32) * scale
            assert np.array_equal(agent(x), ref) and np.array_equal(host(x), ref), M


@pytest.mark.parametrize("K", [1, 31, 32, 70, 576, 1537])
def test_the_avx2_decode_dot_gives_the_exact_int32_sums(K):
    """Decode's W8A8 GEMV runs vpmaddubsw on |w| and a * sign(w) where the CPU has AVX2 (kernels/simd.py): every
    weight (-128 too) against activations clipped to +-127, K with and without a tail past the 32-byte steps."""
    import platform

    from edgeprobe_kernels import simd
    from edgeprobe_kernels.int8_gemm import linear_w8a8_gemv

    if platform.machine() in ("x86_64", "AMD64"):  # this CPU's own word for it, not numba's
        flags = open("/proc/cpuinfo").read()
        assert simd.AVX2 == (" avx2" in flags)
        if os.environ.get("EDGEPROBE_VNNI", "1") != "0":  # vpdpbusd (64 bytes a step) where the CPU has it
            assert simd.VNNI == (simd.AVX2 and all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512_vnni")))
    rng = np.random.default_rng(K)
    w = rng.integers(-128, 128, (67, K), dtype=np.int8)
    w[0], w[1] = -128, 127  # the extremes: |-128| is 128 unsigned, 2 * 128 * 127 pair sums still fit int16
    x = (rng.standard_normal((3, K)) * 4).astype(np.float32)
    x[0] = 1e3  # clipped to 127 everywhere
    x[1] = -1e3
    scale = (rng.random(67) * 0.01).astype(np.float32)
    ref = gemm_s8s32_ref(quantize_per_tensor(x, 0.031), np.ascontiguousarray(w.T)).astype(np.float32) * scale
    assert np.array_equal(linear_w8a8_gemv(x, 0.031, w, scale), ref)
    strided = np.repeat(w, 2, axis=1)[:, ::2]  # the same weights as a strided view: copied, never read as contiguous
    assert np.array_equal(linear_w8a8_gemv(x, 0.031, strided, scale), ref)


GEMM_SHAPES = [(4, 32, 2), (9, 70, 37), (64, 576, 192), (67, 128, 38), (131, 1537, 45)]


@pytest.mark.skipif(not int8_gemm.GEMM_INT8, reason="the AVX2 int8 GEMM needs numba on an AVX2 CPU (and "
                    "EDGEPROBE_INT8_GEMM unset): test_without_the_avx2_gemm_a_w8a8_linear_runs_the_exact_blas_path "
                    "tests what runs instead")
@pytest.mark.parametrize("M,K,N", GEMM_SHAPES)
def test_the_avx2_int8_gemm_gives_the_exact_int32_sums(M, K, N):
    """Prefill's W8A8 GEMM (4 x 2 blocks of vpmaddubsw, 4 x 4 of vpdpbusd, with the block's epilogue in vectors
    where K has no tail): rows past the last block of 4, an odd channel at a chunk's end, K tails past 32 bytes,
    -128 weights and clipped activations; read-only weights as blobs are, transposed from the record's k-major
    layout."""
    rng = np.random.default_rng(M + K + N)
    wt = rng.integers(-128, 128, (K, N), dtype=np.int8)
    wt[:, 0], wt[:, -1] = -128, 127
    x = (rng.standard_normal((M, K)) * 4).astype(np.float32)
    x[0], x[-1] = 1e3, -1e3
    scale = (rng.random(N) * 0.01).astype(np.float32)
    ref = gemm_s8s32_ref(quantize_per_tensor(x, 0.031), wt).astype(np.float32) * scale
    blob = np.frombuffer(wt.tobytes(), np.int8).reshape(wt.shape)
    w = int8_gemm.rows_major(blob)
    assert w.flags.c_contiguous and np.array_equal(w, wt.T)
    assert np.array_equal(int8_gemm.linear_w8a8_gemm(x, 0.031, w, scale), ref)  # VNNI where the CPU has it
    strided = np.repeat(w, 2, axis=1)[:, ::2]  # copied, never read as contiguous
    assert np.array_equal(int8_gemm.linear_w8a8_gemm(x, 0.031, strided, scale), ref)
    y = np.empty_like(ref)  # the AVX2 kernel itself, which CPUs without AVX-512 VNNI run: the same sums
    int8_gemm._linear_w8a8_gemm_nb(x, np.float32(0.031), w, scale, y)
    assert np.array_equal(y, ref)


@pytest.mark.parametrize("M,K,N", GEMM_SHAPES)
def test_without_the_avx2_gemm_a_w8a8_linear_runs_the_exact_blas_path(M, K, N, monkeypatch):
    """What a CPU without AVX2 runs (forced here on any CPU): the AVX2 entry point refuses, and a w8a8 linear of any
    row count gives the exact int32 sums (the decode GEMV for few rows; else float32 BLAS on the codes, K <= 1024,
    or int32 blocks)."""
    monkeypatch.setattr(int8_gemm, "GEMM_INT8", False)
    rng = np.random.default_rng(M + K + N)
    wt = rng.integers(-128, 128, (K, N), dtype=np.int8)
    wt[:, 0], wt[:, -1] = -128, 127
    x = (rng.standard_normal((M, K)) * 4).astype(np.float32)
    x[0], x[-1] = 1e3, -1e3
    scale = np.float32(0.007)
    ref = gemm_s8s32_ref(quantize_per_tensor(x, 0.031), wt).astype(np.float32) * np.float32(0.031 * 0.007)
    with pytest.raises(RuntimeError, match="AVX2"):
        int8_gemm.linear_w8a8_gemm(x, 0.031, int8_gemm.rows_major(wt), np.full(N, scale))
    blobs = {"w": wt}
    for keep_f32 in (False, True):  # the host's simulation and the agent's linear
        assert np.array_equal(run_w8a8({"wt": "w", "scale_a": 0.031, "scale_w": 0.007}, blobs.get, None,
                                       keep_f32=keep_f32)(x), ref), keep_f32


def test_q8_0_head_is_smollm2s_own_and_both_paths_agree(smollm):
    w = np.asarray(smollm.output_weight, np.float32)
    q, d = quantize_q8_0(w)
    assert np.array_equal(dequantize_q8_0(q, d), w)  # the GGUF's Q8_0 head, given back exactly
    from edgeprobe_kernels.q8_0 import GEMV_M

    x = np.random.default_rng(0).standard_normal((GEMV_M + 1, w.shape[1])).astype(np.float32)
    ref = x @ w.T
    fast = matmul_q8_0(x[:4], q, d)          # the decode kernel (numba)
    blas = matmul_q8_0(x, q, d)              # rows > GEMV_M: dequantized blocks through BLAS
    scale = np.abs(ref).max()
    assert np.abs(fast - ref[:4]).max() < 1e-5 * scale and np.abs(blas - ref).max() < 1e-5 * scale
    assert (fast.argmax(1) == ref[:4].argmax(1)).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(w[:, :50])
    with pytest.raises(ValueError, match="cannot take rows"):
        matmul_q8_0(x[:, :64], q, d)


def test_quantized_models_carry_a_q8_0_head_the_float_one_does_not():
    m = toy_model(hidden=32)
    assert quantize(m, "w8a8", calibration_profile(m, np.arange(40) % 48, tokens=40, window=20,
                                                   progress=False)).manifest["head"]["kind"] == "q8_0"
    assert quantize(m, "float").manifest["head"] is None


@pytest.mark.parametrize("scheme", ["w8a8", "w8a8c-shadow"])
def test_a_fused_decode_step_computes_what_its_ops_compute(scheme, monkeypatch):
    """Bit for bit, with each layer's sibling linears (q, k, v; gate, up) computed in one grouped call (the sub-op
    path: w8a8 layers otherwise run as one compiled call, tests/test_compiled_layer.py)."""
    from edgeprobe_agent.ops import compiled
    from edgeprobe_kernels import int8_gemm

    monkeypatch.setattr(compiled, "ENABLED", False)
    grouped = []
    real = int8_gemm.linear_w8a8_gemv_group
    monkeypatch.setattr(int8_gemm, "linear_w8a8_gemv_group", lambda *a: grouped.append(a[3].shape) or real(*a))
    m = toy_model(layers=3, hidden=32)
    qm = quantize(m, scheme, calibration_profile(m, np.arange(60) % 48, tokens=60, window=30, progress=False))
    cfg = qm.manifest["config"]
    prompt = np.arange(7, dtype=np.int32) % cfg["vocab_size"]
    fused = prefill_plan(qm.manifest, 1, session=True)
    # the whole step one op: embed, the layers (each a fused op), the final norm and the head
    (step,) = fused["ops"]
    assert step["name"] == "step" and step["kind"] == "fused" and fused["outputs"] == ["step"]
    names = [s["name"] for s in step["attrs"]["ops"]]  # w8a8c-shadow: layer 0's norm and shadow embedding too
    assert names[0] == "embed" and names[-2:] == ["output_norm", "lm_head"]
    assert [n for n in names if n.count(".") == 1] == [f"blk.{i}" for i in range(cfg["n_layers"])]
    assert all(s["kind"] in ("fused", "embed", "rms_norm", "lm_head") for s in step["attrs"]["ops"])
    assert {o["lane"] for o in fused["ops"]} == {"cpu"}  # mllm-NPU decodes on its CPU backend
    unfused = {**fused, "ops": [s for o in fused["ops"] for s in _unfuse(o)], "outputs": ["step"]}
    outs = []
    for plan in (fused, unfused):
        out, events = step_after_prompt(qm, plan, prompt)
        outs.append(out)
        if plan is fused:  # each sub-op's own event, timed inside the one op, as if dispatched alone
            by = {e["name"]: e for e in events}
            assert [e["name"] for e in events] == names and "step" not in by
            for i in range(cfg["n_layers"]):
                e = by[f"blk.{i}"]
                assert (e["kind"] == "fused" and e["layer"] == i and e["lane"] == "cpu"
                        and e["shape"] == [1, cfg["hidden"]])
                reads = sorted({r["op"] for r in step["attrs"]["ops"][names.index(f"blk.{i}")]["inputs"] if "op" in r})
                assert e["deps"] == reads and (f"blk.{i - 1}" in reads if i else "embed" in reads)
                assert e["flops"] > 0 and {"linear", "attention", "rms_norm"} <= set(e["parts_us"])
            for e in events:
                assert all(by[d]["end_us"] <= e["start_us"] for d in e["deps"]) and e["end_us"] > e["start_us"]
                assert e["lane"] == "cpu" and e["bytes_out"] > 0 and e["chunk"] == 0
            assert by["embed"]["deps"] == [] and by["embed"]["shape"] == [1, cfg["hidden"]]
            assert (by["output_norm"]["deps"] == [f"blk.{cfg['n_layers'] - 1}"]
                    and by["lm_head"]["deps"] == ["output_norm"])
            assert by["lm_head"]["shape"] == [1, cfg["vocab_size"]] and by["lm_head"]["flops"] == \
                2 * cfg["hidden"] * cfg["vocab_size"]
    assert np.array_equal(outs[0], outs[1])
    assert len(grouped) == 2 * cfg["n_layers"]  # q, k, v and gate, up of each layer: one call each


def test_grouped_w8a8_gemv_gives_each_linears_own_bits():
    from edgeprobe_kernels.int8_gemm import linear_w8a8_gemv, linear_w8a8_gemv_group

    rng = np.random.default_rng(3)
    K, sizes, sas = 96, (40, 8, 8), (0.031, 0.02, 0.05)
    ws = [rng.integers(-127, 128, (n, K), dtype=np.int8) for n in sizes]
    scales = [(rng.random(n) * 0.01).astype(np.float32) for n in sizes]
    for M in (1, 3):
        x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
        x[0, :5] = [1e3, -1e3, 0.5 * 0.031, 1.5 * 0.031, -2.5 * 0.031]  # clipped, and halves rounded to even
        y = linear_w8a8_gemv_group(x, np.array(sas, np.float32), np.repeat(np.arange(3, dtype=np.int32), sizes),
                                   np.concatenate(ws), np.concatenate(scales))
        cols = np.cumsum((0,) + sizes)
        for p in range(3):
            assert np.array_equal(y[:, cols[p]:cols[p + 1]], linear_w8a8_gemv(x, sas[p], ws[p], scales[p])), (M, p)


def _unfuse(op):
    """The sub-ops of a fused op as plain ops again (inputs by name), for the comparison above."""
    if op["kind"] != "fused":
        return [op]
    out = []
    subs = op["attrs"]["ops"]
    for i, s in enumerate(subs):
        ins = [op["inputs"][r["arg"]] if "arg" in r else r for r in s["inputs"]]
        name = op["name"] if i == len(subs) - 1 else s["name"]
        out += _unfuse({"name": name, "kind": s["kind"], "lane": op["lane"], "inputs": ins, "attrs": s["attrs"],
                        "layer": s.get("layer", op["layer"])})  # a layer of the step's fused op: its ops too
    return out


@pytest.mark.parametrize("attrs,match", [
    ({}, "non-empty list"),
    ({"ops": [{"name": "a", "kind": "fused", "inputs": []}]}, "non-empty list"),  # a layer with no ops
    ({"ops": [{"name": "a", "kind": "fused", "inputs": [], "attrs": {"ops": [
        {"name": "b", "kind": "fused", "inputs": [], "attrs": {"ops": [
            {"name": "c", "kind": "add", "inputs": []}]}}]}}]},
     "one level deep"),
    ({"ops": [{"name": "a", "kind": "fused", "inputs": [], "layer": "x", "attrs": {"ops": [
        {"name": "c", "kind": "add", "inputs": []}]}}]}, "int layer"),
    ({"ops": [{"name": "a", "kind": "fused", "inputs": [],
               "attrs": {"ops": [{"name": "c", "kind": "add", "inputs": []}]}},
              {"name": "d", "kind": "add", "inputs": [], "deps": "a"}]}, "list of names as deps"),  # a step op's sub-op
    ({"ops": [{"name": "a", "kind": "add", "inputs": [{"arg": 5}]}]}, "arg"),
    ({"ops": [{"name": "a", "kind": "add", "inputs": [{"op": "later"}]},
              {"name": "later", "kind": "add", "inputs": []}]},
     "earlier sub-op"),
])
def test_a_malformed_fused_op_is_refused_before_running(attrs, match):
    plan = {"ops": [{"name": "f", "kind": "fused", "lane": "cpu", "inputs": [{"input": "x"}], "attrs": attrs}]}
    with pytest.raises(AgentError, match=match):
        validate(plan, has_blob=lambda s: True)


def test_fusion_leaves_runs_whose_inner_values_are_read_elsewhere():
    plan = {"ops": [{"name": "a", "kind": "add", "lane": "cpu", "layer": 0, "inputs": [{"input": "x"}]},
                    {"name": "b", "kind": "add", "lane": "cpu", "layer": 0, "inputs": [{"op": "a"}]},
                    {"name": "c", "kind": "add", "lane": "cpu", "layer": 1, "inputs": [{"op": "a"}, {"op": "b"}]}],
            "outputs": ["c"]}
    assert [o["name"] for o in fuse_layers(plan)["ops"]] == ["a", "b", "c"]  # a leaves layer 0 besides b


def test_decode_sized_norms_and_rope_match_the_numpy_ones():
    """rms_norm and apply_rope on a decode step's few rows take numba kernels: the same values as numpy's to
    float32 rounding (the host's forward pass uses the same functions, so host and agent agree)."""
    from edgeprobe_kernels import llama_ops as L

    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((3, 96)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    q = rng.standard_normal((3, 1, 4, 16)).astype(np.float32)
    cos, sin = L.rope_tables(16, 1e4, 37, 1)
    fast = L.rms_norm(x, w, 1e-5), L.apply_rope(q, cos, sin)
    few, L.FEW_ROWS = L.FEW_ROWS, 0
    try:
        slow = L.rms_norm(x, w, 1e-5), L.apply_rope(q, cos, sin)
    finally:
        L.FEW_ROWS = few
    assert np.allclose(fast[0], slow[0], rtol=1e-6, atol=1e-6) and np.array_equal(fast[1], slow[1])


@pytest.mark.parametrize("rows", [9, 64, 255, 300])
def test_rope_at_every_row_count_is_the_numpy_formula_bit_for_bit(monkeypatch, rows):
    """apply_rope takes its numba kernel at any row count (a 64-token prompt's included, where numpy's strided pairs
    were 6x slower), whole or split: each element is numpy's x0 * c - x1 * s and x0 * s + x1 * c in float32."""
    from edgeprobe_kernels import llama_ops as L

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((2, rows, 9, 64)).astype(np.float32)
    cos, sin = L.rope_tables(64, 1e4, 11, rows)
    xp = x.reshape(2, rows, 9, 32, 2)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    want = np.stack([xp[..., 0] * c - xp[..., 1] * s, xp[..., 0] * s + xp[..., 1] * c], axis=-1).reshape(x.shape)
    for splits in (False, True):
        monkeypatch.setattr(L._threads, "ROW_SPLITS", splits)
        got = L.apply_rope(x, cos, sin)
        assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("rows", [9, 64, 255, 300])
def test_prompt_norms_and_adds_at_every_row_count_are_the_numpy_forms_bit_for_bit(monkeypatch, rows):
    """rms_norm and add past decode's rows take numba (numpy's sums of squares, then the scaling; IEEE adds left to
    right) whole or in row blocks: the bits of numpy's x * (1 / rms)[:, None] * w and a + b + c."""
    from edgeprobe_kernels import llama_ops as L

    rng = np.random.default_rng(rows)
    x, b, c = (rng.standard_normal((rows, 576)).astype(np.float32) * 3 for _ in range(3))
    w = rng.standard_normal(576).astype(np.float32)
    ms = np.einsum("nc,nc->n", x, x) / np.float32(576)
    want_norm = x * (1.0 / np.sqrt(ms + np.float32(1e-5))).astype(np.float32)[:, None] * w
    for splits in (False, True):
        monkeypatch.setattr(L._threads, "ROW_SPLITS", splits)
        got = L.rms_norm(x, w, 1e-5)
        assert got.dtype == np.float32 and np.array_equal(got, want_norm)
        assert np.array_equal(L.add(x, b), x + b) and np.array_equal(L.add(x, b, c), (x + b) + c)
        assert np.array_equal(L.add(x[:, :500], b[:, :500]), x[:, :500] + b[:, :500])  # strided rows


def test_the_agent_warms_every_kernel_it_calls():
    from edgeprobe_kernels.decode_layer import layer_w8a8
    from edgeprobe_kernels.warm import warm

    gemm = ["linear_w8a8_gemm"] if int8_gemm.GEMM_INT8 else []
    layer = ["decode_layer"] if layer_w8a8 is not None else []
    assert warm() == ["build_team", "linear_w8a8_gemv", "linear_w8a8_gemv_group", "as_f32", "rows_major", *gemm,
                      "matmul_q8_0", "shadow_gemm", "shadow_delta_onepass", "gemm_f16w_seq",
                      "gemv_q4_seq, q4_rows_t", "rms_norm, apply_rope", "prompt rows: rms_norm, add, apply_rope",
                      "attention (decode rows)", *layer]


def test_the_parallel_float32_copy_of_an_int8_weight_holds_its_values():
    from edgeprobe_kernels.int8_gemm import as_f32

    w = np.random.default_rng(0).integers(-127, 128, (577, 193)).astype(np.int8)
    for a in (w, w[:, 5:100], np.frombuffer(w.tobytes(), np.int8).reshape(w.shape)):  # strided; read-only, as blobs are
        f = as_f32(a)
        assert f.dtype == np.float32 and f.flags.c_contiguous and f.flags.writeable and np.array_equal(f, a)


def test_agent_workers_reuse_threads_and_never_make_a_task_wait():
    """A decode step runs on the thread that ran the last one (its OpenMP team); a run that blocks does not hold
    up the next."""
    import queue
    import threading
    import time

    from edgeprobe_agent.server import _Workers

    w = _Workers(keep=2)
    gate, seen = threading.Event(), queue.Queue()
    w.submit(lambda: (seen.put(threading.get_ident()), gate.wait(10)))
    w.submit(lambda: seen.put(threading.get_ident()))  # must run while the first still blocks
    a, b = seen.get(timeout=10), seen.get(timeout=10)
    assert a != b and not gate.is_set()

    def idle(n):
        deadline = time.monotonic() + 10
        while len(w._idle) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(w._idle)

    gate.set()
    assert idle(2) == 2
    ran = []
    for _ in range(5):  # one after another: each on the thread the last one ran on
        w.submit(lambda: seen.put(threading.get_ident()))
        ran.append(seen.get(timeout=10))
        assert idle(2) == 2
    assert len(set(ran)) == 1 and ran[0] in {a, b}  # no new thread, and no hopping between the two
    gate2, started = threading.Event(), queue.Queue()
    for _ in range(3):  # three at once: a third thread starts, and ends when done (keep = 2)
        w.submit(lambda: (started.put(threading.get_ident()), gate2.wait(10)))
    assert len({started.get(timeout=10) for _ in range(3)}) == 3
    gate2.set()
    assert idle(2) == 2
    time.sleep(0.2)
    assert len(w._idle) == 2


def test_arena_copies_are_exact_aligned_and_disjoint_across_threads():
    import threading

    from edgeprobe_kernels.arena import ALIGN, Arena

    arena = Arena(chunk=1 << 16)
    rng = np.random.default_rng(5)
    srcs = [rng.integers(-127, 128, (int(rng.integers(1, 40)), int(rng.integers(1, 300))), dtype=np.int8)
            for _ in range(200)] + [rng.random((7, 9)).astype(np.float32).T]  # a transposed (strided) float view too
    out = [None] * len(srcs)

    def work(idx):
        for i in idx:
            out[i] = arena.copy(srcs[i])
    threads = [threading.Thread(target=work, args=(range(k, len(srcs), 2),)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s, o in zip(srcs, out):
        assert np.array_equal(s, o) and o.dtype == s.dtype and o.flags.c_contiguous and o.flags.writeable
        assert o.ctypes.data % ALIGN == 0
    spans = sorted((o.ctypes.data, o.ctypes.data + o.nbytes) for o in out)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two copies share a byte
    big = rng.integers(0, 5, 1 << 15, dtype=np.int8)  # above a quarter chunk: its own array
    assert np.array_equal(arena.copy(big), big)


def test_a_host_process_runs_numba_on_tbb_and_the_agent_keeps_openmp(tmp_path):
    import subprocess
    import sys

    code = ("import numpy as np, numba\n"
            "from edgeprobe_kernels.int8_gemm import gemv_s8s32\n"
            "gemv_s8s32(np.ones((1, 64), np.int8), np.ones((8, 64), np.int8))\n"
            "print(numba.threading_layer())")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    host = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert host.stdout.strip() == "tbb", host.stderr[-2000:]  # the tbb wheel is a dependency on x86-64 Linux
    agent = subprocess.run([sys.executable, "-c", "import edgeprobe_agent.__main__\n" + code], capture_output=True,
                           text=True, env=env, timeout=120)
    assert agent.stdout.strip() == "omp", agent.stderr[-2000:]


def test_an_op_alone_splits_attention_blocks_and_swiglu_rows_over_the_cores_with_the_same_bits():
    """The agent's auto lanes let an op computing alone run its query blocks / rows on every core, BLAS on one
    thread meanwhile (llama_ops._split, threads.Cores.single_blas); the result is the unsplit one, bit for bit."""
    import contextlib

    from edgeprobe_kernels import llama_ops

    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 300, 9, 64)).astype(np.float32)
    k = rng.standard_normal((1, 3, 300, 64)).astype(np.float32)
    v = rng.standard_normal((1, 3, 300, 64)).astype(np.float32)
    g, u = (rng.standard_normal((600, 96)).astype(np.float32) for _ in range(2))
    calls = []
    want = [llama_ops.attention(q, k, v, 0), llama_ops.attention(q, k, v, 0, window=100), llama_ops.swiglu_act(g, u)]

    @contextlib.contextmanager
    def hook():
        calls.append(threading.current_thread().name)
        yield

    old, llama_ops.SPLIT_HOOK = llama_ops.SPLIT_HOOK, hook
    try:
        got = [llama_ops.attention(q, k, v, 0), llama_ops.attention(q, k, v, 0, window=100), llama_ops.swiglu_act(g, u)]
    finally:
        llama_ops.SPLIT_HOOK = old
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert len(calls) == (3 if llama_ops._op_cores() >= 2 else 0)  # one split per op where the op has 2+ cores


def test_swiglu_on_one_temporary_is_the_expression_bit_for_bit():
    """swiglu_act computes g / (1.0 + exp(-g)) * u in place on one temporary (_silu_mul): the same float32 bits,
    signed zeros (exp overflowing to inf), infinities and NaN included, at decode, prompt and split row counts."""
    from edgeprobe_kernels import llama_ops

    rng = np.random.default_rng(5)
    for rows in (1, 7, 64, 255, 256, 600):
        g = (rng.standard_normal((rows, 96)) * 40).astype(np.float32)
        u = rng.standard_normal((rows, 96)).astype(np.float32)
        g[0, :4] = [-200.0, np.inf, -np.inf, np.nan]
        u[0, 4] = -0.0
        with np.errstate(over="ignore", invalid="ignore"):  # the overflows and NaN above are the point
            want = g / (1.0 + np.exp(-g)) * u
            got = llama_ops.swiglu_act(g, u)
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), rows


def test_a_kernel_compiled_by_another_process_gives_the_same_bits(tmp_path):
    """numba compiles a kernel once per array type (a blob is read-only, an activation writable) and caches each
    compilation from whichever process met it first. Under fastmath LLVM chose each compilation's order of a sum:
    the agent's read-only Q8_0 head and a host's writable one summed SmolLM2's logits ~1e-5 apart. The head and
    the decode-row RMSNorm fix their sums' order in the code, so the bits are the same whoever compiled them."""
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), NUMBA_NUM_THREADS="1", NUMBA_THREADING_LAYER="omp")
    agent = subprocess.run([sys.executable, "-c", "from edgeprobe_kernels.warm import warm; warm()"],
                           capture_output=True, text=True, env=env, timeout=300)  # read-only kernels, as the agent
    assert agent.returncode == 0, agent.stderr[-2000:]
    code = ("import numpy as np\n"
            "from edgeprobe_kernels.q8_0 import matmul_q8_0, quantize_q8_0\n"
            "from edgeprobe_kernels.llama_ops import rms_norm\n"
            "from edgeprobe_kernels.warm import _ro\n"
            "rng = np.random.default_rng(0)\n"
            "q, d = quantize_q8_0(rng.standard_normal((2048, 576)).astype(np.float32))\n"
            "x, w = rng.standard_normal((2, 576)).astype(np.float32), rng.standard_normal(576).astype(np.float32)\n"
            "head = np.array_equal(matmul_q8_0(x, q, d), matmul_q8_0(x, _ro(q), _ro(d)))\n"
            "norm = np.array_equal(rms_norm(x, w, 1e-5), rms_norm(x, _ro(w), 1e-5))\n"
            "print(head, norm)")
    host = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(env, NUMBA_NUM_THREADS="2", NUMBA_THREADING_LAYER="tbb"), timeout=300)
    assert host.stdout.split() == ["True", "True"], host.stdout + host.stderr[-2000:]
