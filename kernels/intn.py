"""Per-channel linear quantization to INT2/INT4/INT8 (EdgeMoE §3.2, after Kim et al. 2022, MoQE).

Each output channel (row) n of W float32[N, K] gets one scale s_n = max_k |W[n, k]| / qmax with
qmax = 2^(bits-1) - 1, and codes q = clip(round(W / s), -qmax, qmax). At 2 bits that is ternary
{-1, 0, +1}: the paper's "scale from the channel's largest magnitude and the width's range" taken
literally, which is why INT2 costs accuracy. Codes are stored offset by qmax + 1 as unsigned
`bits`-bit fields, packed little-end first into bytes (8 bits: plain int8). Scales are float16.
"""
from __future__ import annotations

import numpy as np

BITS = (2, 4, 8)


def _check(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"per-channel quantization supports {BITS} bits, got {bits!r}")


def packed_bytes(N: int, K: int, bits: int) -> int:
    """Bytes of the packed codes of an [N, K] matrix (rows padded to whole bytes)."""
    return N * -(-K * bits // 8)


def quantize_channels(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """w float32[N, K] -> (codes uint8[N, ceil(K*bits/8)], scales float16[N])."""
    _check(bits)
    w = np.asarray(w, np.float32)
    qmax = (1 << (bits - 1)) - 1
    s = (np.abs(w).max(axis=1) / qmax).astype(np.float16)
    s16 = np.where(s == 0, np.float16(1), s).astype(np.float32)  # all-zero rows: any scale works
    q = np.clip(np.rint(w / s16[:, None]), -qmax, qmax).astype(np.int16)
    if bits == 8:
        return q.astype(np.int8).view(np.uint8), s
    per = 8 // bits
    N, K = q.shape
    Kp = -(-K // per) * per
    u = np.zeros((N, Kp), np.uint8)
    u[:, :K] = (q + qmax + 1).astype(np.uint8)
    u = u.reshape(N, Kp // per, per)
    packed = np.zeros((N, Kp // per), np.uint8)
    for j in range(per):
        packed |= u[:, :, j] << np.uint8(j * bits)
    return packed, s


def dequantize_channels(codes: np.ndarray, scales: np.ndarray, bits: int, K: int) -> np.ndarray:
    """Inverse of quantize_channels: -> float32[N, K]."""
    _check(bits)
    scales = np.asarray(scales, np.float16).astype(np.float32)
    if bits == 8:
        return codes.view(np.int8)[:, :K].astype(np.float32) * scales[:, None]
    qmax = (1 << (bits - 1)) - 1
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    N = codes.shape[0]
    u = np.stack([(codes >> np.uint8(j * bits)) & mask for j in range(per)], axis=2).reshape(N, -1)[:, :K]
    return (u.astype(np.float32) - (qmax + 1)) * scales[:, None]
