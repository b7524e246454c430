"""HMX tile layout and tile-group Q4_0 (NPU test-time scaling §5.1), with its byte layout.

HMX layout of a weight W float[N_out, K_in] (the matrix unit computes x[M, K] @ W^T[K, N]):
  1. Take W^T [K, N]; pad K and N with zeros to multiples of 32 (the padding is recorded).
  2. Cut it into 32x32 tiles; tiles are ordered column-major: tile (kt, nt) is number nt * KT + kt.
  3. Inside a tile (rows k, columns n) each pair of rows is interleaved: element order is
     (r2, c, p) -> tile[2 * r2 + p, c], i.e. row 2r2 and row 2r2+1 alternate column by column.
  So every tile is 1024 consecutive values of one stream.
Tile-group quantization: the stream is cut into groups of 32 consecutive values (a 2x16 block of the
tile: 16 columns of a row pair) and each group is Q4_0-quantized (kernels/lut.py rule).
Super-block: 8 consecutive groups = 256 values, stored in 144 bytes:
  bytes   0..15 : the 8 group scales, float16 little-endian, group 0 first
  bytes  16..143: 128 bytes of 4-bit codes; byte b holds value b in its low nibble and value b+128 in
                  its high nibble (one HVX vector: a mask gives values 0..127, a shift gives 128..255)
A tile is exactly 4 super-blocks; a weight is KT * NT * 4 super-blocks.
"""
from __future__ import annotations

import numpy as np

from .lut import GROUP, _f16_values, lut16_dequant, q4_quantize_groups

try:
    import numba
except ImportError:
    numba = None

TILE = 32
SUPER = 8 * GROUP  # values per super-block
SUPER_BYTES = 16 + SUPER // 2


def padded(n: int) -> int:
    return -(-n // TILE) * TILE


def to_tiles(w: np.ndarray) -> np.ndarray:
    """W float[N, K] -> float[KT*NT*1024] stream in HMX order (zero-padded to multiples of 32)."""
    N, K = w.shape
    Kp, Np = padded(K), padded(N)
    wt = np.zeros((Kp, Np), dtype=w.dtype)
    wt[:K, :N] = w.T
    KT, NT = Kp // TILE, Np // TILE
    t = wt.reshape(KT, TILE, NT, TILE).transpose(2, 0, 1, 3)  # [nt, kt, row, col]: column-major tiles
    t = t.reshape(NT, KT, TILE // 2, 2, TILE).transpose(0, 1, 2, 4, 3)  # [nt, kt, r2, c, p]
    return np.ascontiguousarray(t).reshape(-1)


def from_tiles(stream: np.ndarray, N: int, K: int) -> np.ndarray:
    """Inverse of to_tiles: stream -> W [N, K] (padding dropped)."""
    Kp, Np = padded(K), padded(N)
    KT, NT = Kp // TILE, Np // TILE
    t = stream.reshape(NT, KT, TILE // 2, TILE, 2).transpose(0, 1, 2, 4, 3).reshape(NT, KT, TILE, TILE)
    wt = t.transpose(1, 2, 0, 3).reshape(Kp, Np)
    return np.ascontiguousarray(wt[:K, :N].T)


def pack_superblocks(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q uint8[G, 32] codes, d float16[G] (G a multiple of 8) -> uint8[G/8, 144] (layout above)."""
    S = len(q) // 8
    codes = q.reshape(S, SUPER)
    out = np.empty((S, SUPER_BYTES), np.uint8)
    out[:, :16] = d.astype("<f2").reshape(S, 8).view(np.uint8)
    out[:, 16:] = codes[:, :128] | (codes[:, 128:] << 4)
    return out


def unpack_superblocks(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8[S, 144] -> (q uint8[8S, 32], d float16[8S])."""
    S = len(blocks)
    d = np.ascontiguousarray(blocks[:, :16]).view("<f2").reshape(-1).astype(np.float16)
    nib = blocks[:, 16:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=1).reshape(S * 8, GROUP)
    return q, d


def quantize_tiles(w: np.ndarray) -> np.ndarray:
    """W float32[N, K] -> tile-group Q4_0 super-blocks uint8[S, 144]."""
    stream = to_tiles(np.asarray(w, np.float32))
    q, d = q4_quantize_groups(stream.reshape(-1, GROUP))
    return pack_superblocks(q, d)


def dequantize_tiles(blocks: np.ndarray, N: int, K: int) -> np.ndarray:
    """Super-blocks -> W float16[N, K] through the vlut16 kernel, then back from the tile order."""
    q, d = unpack_superblocks(blocks)
    return from_tiles(lut16_dequant(q, d).reshape(-1), N, K)


if numba is not None:
    from .lut import _group_lut

    @numba.njit(parallel=True, nogil=True, cache=True)
    def _tiles_kmajor_nb(blocks, KT, K, N, f16_of, out):
        # one task per 32x32 tile (4 super-blocks); each group's 16 FP16 values built as lut16_dequant builds them
        for t in numba.prange(blocks.shape[0] // 4):
            k0, n0 = (t % KT) * TILE, (t // KT) * TILE
            lut = np.empty(16, np.float32)
            for sb in range(4):
                b = blocks[4 * t + sb]
                for g in range(8):
                    d = f16_of[np.int64(b[2 * g]) | (np.int64(b[2 * g + 1]) << 8)]
                    _group_lut(d, f16_of, lut)
                    for j in range(GROUP):
                        v = g * GROUP + j
                        code = (np.int64(b[16 + v]) & 0x0F) if v < 128 else (np.int64(b[16 + v - 128]) >> 4)
                        e = sb * SUPER + v  # stream order inside the tile: (r2, c, p) -> tile[2 r2 + p, c]
                        k, n = k0 + (e >> 6) * 2 + (e & 1), n0 + ((e & 63) >> 1)
                        if k < K and n < N:
                            out[k, n] = lut[code]


def dequantize_tiles_t(blocks: np.ndarray, N: int, K: int) -> np.ndarray:
    """Super-blocks uint8[S, 144] -> W^T float32[K, N] holding float16 values, in one pass: the k-major weight
    the npu lane's W4A16 GEMM reads. Bit-identical to dequantize_tiles(blocks, N, K).T, ~15x faster (no
    float16 intermediate, no tile transposes: a new agent's first q4_0-tile run prepares 210 of these)."""
    KT, NT = padded(K) // TILE, padded(N) // TILE
    if blocks.ndim != 2 or blocks.shape != (KT * NT * 4, SUPER_BYTES):
        raise ValueError(f"a [{N}, {K}] weight is {KT * NT * 4} super-blocks of {SUPER_BYTES} bytes, "
                         f"got an array of shape {blocks.shape}")
    if numba is None:
        return np.ascontiguousarray(dequantize_tiles(blocks, N, K).T, np.float32)
    out = np.empty((K, N), np.float32)
    _tiles_kmajor_nb(np.ascontiguousarray(blocks, np.uint8), KT, K, N, _f16_values(), out)
    return out


def tiles_q4_rows(blocks: np.ndarray, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Super-blocks uint8[S, 144] -> the npu lane's GEMV layout (kernels/f16_gemm.py gemv_q4_seq), the same codes
    and scales in row order: codes uint8[Kp/2, Np], byte [r, n] = code of W^T[2r, n] | code of W^T[2r+1, n] << 4;
    d16 uint16[Kp/2, Np/16], the FP16 scale bits of the group holding W^T[2r:2r+2, 16c:16c+16]. A tile's group is
    16 columns of one row pair (2 x 16 values), so every group is one cell here: 4.5 bits a weight, as the blocks."""
    KT, NT = padded(K) // TILE, padded(N) // TILE
    if blocks.ndim != 2 or blocks.shape != (KT * NT * 4, SUPER_BYTES):
        raise ValueError(f"a [{N}, {K}] weight is {KT * NT * 4} super-blocks of {SUPER_BYTES} bytes, "
                         f"got an array of shape {blocks.shape}")
    q, d = unpack_superblocks(blocks)
    q = q.reshape(NT, KT, TILE // 2, TILE, 2)  # stream order (r2, c, p) inside each column-major tile
    codes = (q[..., 0] | (q[..., 1] << 4)).transpose(1, 2, 0, 3).reshape(KT * TILE // 2, NT * TILE)
    d16 = d.view(np.uint16).reshape(NT, KT, TILE // 2, 2).transpose(1, 2, 0, 3).reshape(KT * TILE // 2, NT * 2)
    return np.ascontiguousarray(codes), np.ascontiguousarray(d16)
