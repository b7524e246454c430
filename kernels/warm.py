"""Load the numba kernels a run calls, before the first run: a process's first numba call costs ~0.25 s (the
runtime and LLVM start) and each kernel ~20 ms more to load from numba's cache. The agent calls `warm()` when it
starts, before it says it listens, so its first run computes instead of loading (issue 17: the first run within
1.5x of a warm one). Arguments mimic the runtime's: blobs are read-only arrays, activations writable float32."""
from __future__ import annotations

import numpy as np

try:
    import numba as _numba
except ImportError:
    _numba = None

if _numba is not None:
    @_numba.njit(parallel=True, nogil=True, cache=True)
    def _team_nb(out):
        for i in _numba.prange(out.shape[0]):
            out[i] = i


def build_team(threads: int) -> None:
    """Give the calling thread its OpenMP team of `threads` (numba's count for this thread stays `threads`)."""
    if _numba is None or threads < 2:
        return
    _numba.set_num_threads(threads)
    _team_nb(np.empty(threads * 4, np.int64))


def _ro(a: np.ndarray) -> np.ndarray:
    """A read-only array, as a blob read from the store or mapped from flash is."""
    return np.frombuffer(np.ascontiguousarray(a).tobytes(), a.dtype).reshape(a.shape)


def warm() -> list[str]:
    """Call each numba kernel of the agent's lanes once on tiny inputs; returns the names warmed
    (none without numba)."""
    try:
        import numba
    except ImportError:
        return []
    threads = numba.get_num_threads()
    numba.set_num_threads(1)  # one thread: no OpenMP team kept on this thread (see edgeprobe_agent.server._Workers)
    try:
        return _warm()
    finally:
        numba.set_num_threads(threads)


def _warm() -> list[str]:
    from .f16_gemm import gemm_f16w_seq, gemv_q4_seq, q4_rows_t
    from .int8_gemm import GEMM_INT8, as_f32, linear_w8a8_gemm, linear_w8a8_gemv, linear_w8a8_gemv_group, rows_major
    from .q8_0 import matmul_q8_0
    from .shadow import shadow_delta_onepass, shadow_gemm

    x = np.ones((1, 64), np.float32)
    done = []
    _team_nb(np.empty(4, np.int64))  # loaded here, run on this thread's one thread (no team kept)
    done.append("build_team")
    linear_w8a8_gemv(x, 0.5, np.ones((8, 64), np.int8), np.ones(8, np.float32))  # the runner's own copies: writable
    done.append("linear_w8a8_gemv")
    linear_w8a8_gemv_group(x, np.ones(2, np.float32), np.zeros(8, np.int32), np.ones((8, 64), np.int8),
                           np.ones(8, np.float32))
    done.append("linear_w8a8_gemv_group")
    as_f32(_ro(np.ones((8, 64), np.int8)))
    done.append("as_f32")
    for wt in (_ro(np.ones((64, 8), np.int8)), np.ones((64, 8), np.int8)):  # a blob, a column split's copy
        rows_major(wt)
    done.append("rows_major")
    if GEMM_INT8:
        linear_w8a8_gemm(np.ones((9, 64), np.float32), 0.5, np.ones((8, 64), np.int8), np.ones(8, np.float32))
        done.append("linear_w8a8_gemm")
    matmul_q8_0(x, _ro(np.ones((8, 64), np.int8)), _ro(np.ones((8, 2), np.float32)))
    done.append("matmul_q8_0")
    slot = np.full(64, -1, np.int64)
    slot[:2] = [0, 1]
    for cold in (_ro(np.ones((62, 8), np.float32)), np.ones((62, 8), np.float32)):
        shadow_gemm(np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.float32), _ro(slot),
                    _ro(np.ones((2, 8), np.float32)), cold, np.zeros((1, 8), np.float32))
    done.append("shadow_gemm")
    for cold in (_ro(np.ones((62, 8), np.float32)), np.ones((62, 8), np.float32)):
        shadow_delta_onepass(x, 0.5, _ro(slot), _ro(np.ones((2, 8), np.float32)), cold, 8)
    done.append("shadow_delta_onepass")
    gemm_f16w_seq(x, np.ones((64, 8), np.float32))
    done.append("gemm_f16w_seq")
    codes, d16 = _ro(np.full((32, 16), 0x99, np.uint8)), _ro(np.full((32, 1), 0x3C00, np.uint16))  # scale 1.0
    gemv_q4_seq(x, codes, d16, 16, 64)  # q4_0-tile's decode GEMV and its prefill's dequantizer
    q4_rows_t(codes, d16, 16, 64)
    done.append("gemv_q4_seq, q4_rows_t")
    from .llama_ops import apply_rope, attention, rms_norm

    rms_norm(x, _ro(np.ones(64, np.float32)), 1e-5)
    rms_norm(x, np.ones(64, np.float32), 1e-5)
    apply_rope(np.ones((1, 1, 2, 8), np.float32), np.ones((1, 4), np.float32), np.ones((1, 4), np.float32))
    done.append("rms_norm, apply_rope")
    from .llama_ops import SPLIT_ROWS, add

    xs, ones = np.ones((SPLIT_ROWS, 8), np.float32), np.ones((SPLIT_ROWS, 4), np.float32)  # a prompt's row blocks
    rms_norm(xs, np.ones(8, np.float32), 1e-5)
    add(xs, xs)
    apply_rope(xs.reshape(1, SPLIT_ROWS, 1, 8), ones, ones)
    done.append("prompt rows: rms_norm, add, apply_rope")
    kv = np.ones((1, 1, 4, 8), np.float32)  # a session's whole cache: C-contiguous, longer than the positions read
    attention(np.ones((1, 1, 2, 8), np.float32), kv, kv.copy(), 1)
    done.append("attention (decode rows)")
    from .decode_layer import layer_w8a8, layers_w8a8, typed_list

    if layer_w8a8 is not None:  # a fused decode layer's call (its norms' weights blobs, read-only, or not) and a
        D, F, d = 64, 32, 16    # step's layers' one call (device_agent/ops/compiled.py)
        w8 = lambda n, k: np.ones((n, k), np.int8)
        f32 = lambda n, v=1.0: np.full(n, v, np.float32)
        i32 = lambda parts: np.concatenate([np.full(n, p, np.int32) for p, n in enumerate(parts)])
        cs = np.ones((1, d // 2), np.float32)
        kv = lambda: np.zeros((1, 1, 4, d), np.float32)
        gemvs = [(w8(6 * d, D), f32(3), i32((4 * d, d, d)), f32(6 * d, 1e-3)), (w8(D, 4 * d), f32(1), i32((D,)),
                 f32(D, 1e-3)), (w8(2 * F, D), f32(2), i32((F, F)), f32(2 * F, 1e-3)),
                 (w8(D, F), f32(1), i32((D,)), f32(D, 1e-3))]
        for norm in (_ro(f32(D)), f32(D)):
            (w3, sa3, p3, s3), (wo, sao, po, so), (w2, sa2, p2, s2), (wd, sad, pd, sd) = gemvs
            layer_w8a8(x.copy(), norm, np.float32(1e-5), w3, sa3, p3, s3, 4, 1, cs, cs, kv(), kv(), 0, 0, 0.25, 0.0,
                       wo, sao, po, so, norm, np.float32(1e-5), w2, sa2, p2, s2, wd, sad, pd, sd,
                       np.zeros(6, np.int64))
        lists = [typed_list([g[i], g[i]]) for g in gemvs for i in range(4)]
        norms, eps = np.ones((2, D), np.float32), np.full((2, 2), 1e-5, np.float32)
        caches = [typed_list([kv(), kv()]) for _ in range(2)]
        layers_w8a8(x.copy(), norms, norms.copy(), eps, *lists, *caches, 4, 1, cs, cs, 0, 0, 0.25, 0.0,
                    np.zeros((2, 6), np.int64), np.zeros((2, 2), np.int64))
        done.append("decode_layer")  # and q4_0-tile layers': the same compiled function (decode_layer._layers_nb)
    return done
