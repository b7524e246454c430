"""Quantization schemes of the five papers: how each linear is stored and what it computes.

A scheme has a `build(name, W, ctx, store) -> record` (weights -> blobs + a JSON record for the
manifest); the matching runner in `edgeprobe_kernels.linear_records` computes y = x @ W^T the way the
device would. Records and blobs are all a device agent needs; the host simulation runs the same kernels.
"""
from __future__ import annotations

import numpy as np

from edgeprobe_kernels.int8_gemm import quantize_per_tensor
from edgeprobe_kernels.intn import quantize_channels
from edgeprobe_kernels.linear_records import RUNNERS
from edgeprobe_kernels.lut import GROUP
from edgeprobe_kernels.names import INPUT_HOOK
from edgeprobe_kernels.tiles import TILE, padded, quantize_tiles

from .blobs import BlobStore

# Which hook point feeds which linear (activation statistics are per hook point): the names table's
INPUT_POINT = INPUT_HOOK


def input_point(linear_name: str) -> str:
    """"blk.3.ffn_up" -> "blk.3.ffn_in"."""
    blk, i, op = linear_name.split(".")
    return f"{blk}.{i}.{INPUT_POINT[op]}"


def record(scheme: str, fields: dict) -> dict:
    """A manifest record: `scheme` names the recipe its runner computes (linear_records.RUNNERS), fields its blobs and
    numbers. It also carries the same name as `kind`, the field's name before, for readers that still look there."""
    return {"scheme": scheme, "kind": scheme, **fields}


def _w_scale(w: np.ndarray) -> float:
    return max(float(np.abs(w).max()), 1e-12) / 127.0


# ---- float ----------------------------------------------------------------------------------------

def build_float(name, w, ctx, store: BlobStore) -> dict:
    return record("float", {"shape": list(w.shape), "w": store.put(w.astype(np.float32), "weight")})


# ---- w8a8: per-tensor int8 weights and activations (no outlier handling) --------------------------

def build_w8a8(name, w, ctx, store) -> dict:
    sw = _w_scale(w)
    clip = ctx["clips"][input_point(name)]
    return record("w8a8", {"shape": list(w.shape), "wt": store.put(quantize_per_tensor(w.T, sw), "weight"),
                           "scale_w": sw, "scale_a": clip / 127.0})


# ---- w8a8-shadow: mllm-NPU eq. 1 -------------------------------------------------------------------

def build_shadow(name, w, ctx, store) -> dict:
    rec = build_w8a8(name, w, ctx, store)
    layer = int(name.split(".")[1])
    rec.update(record("w8a8-shadow", {}), clip=ctx["clips"][input_point(name)],
               shadow=layer not in ctx["pruned_layers"])
    return _add_shadow(rec, name, w, ctx, store)


def _add_shadow(rec, name, w, ctx, store) -> dict:
    """The float rows of W^T for mllm-NPU's shadow GEMM: hot input channels resident, the rest in flash."""
    point = input_point(name)
    if rec["shadow"]:
        K = w.shape[1]
        hot = np.asarray(ctx["hot"].get(point, np.zeros(0, np.int64)), np.int64)
        cold = np.setdiff1d(np.arange(K), hot)
        slot = np.empty(K, np.int64)
        slot[hot] = np.arange(len(hot))
        slot[cold] = -1 - np.arange(len(cold))
        wt = np.ascontiguousarray(w.T.astype(np.float32))  # row j = float weights of input channel j
        rec.update(hot_channels=len(hot), slot=store.put(slot, "shadow-index"),
                   hot=store.put(wt[hot], "shadow-resident"), cold=store.put(wt[cold], "shadow-flash"))
    return rec


# ---- w8a8c-shadow: per-output-channel int8 weight scales (QNN/HTP's axis quantization), per-tensor int8
# activations clipped at CHANNEL_CLIP_PERCENTILE, every outlier above the clip in the float shadow GEMM --------

def build_channel_shadow(name, w, ctx, store) -> dict:
    """mllm-NPU eq. 1 with W's scales per output channel: y = s_a * s_w[n] * (q(x) . q(W[n])) + shadow. The
    tighter clip (99th percentile, not 99.99) spends int8's range on the bulk of x; no layer is pruned."""
    sw = (np.maximum(np.abs(w).max(axis=1), 1e-12) / 127.0).astype(np.float32)  # float32[N]
    wq = np.clip(np.rint(w / sw[:, None]), -127, 127).astype(np.int8)
    clip = ctx["clips_ch"][input_point(name)]
    rec = record("w8a8c-shadow", {"shape": list(w.shape), "wt": store.put(np.ascontiguousarray(wq.T), "weight"),
                                  "scale_w_ch": store.put(sw, "weight-scales"), "scale_a": clip / 127.0, "clip": clip,
                                  "shadow": True, "clip_percentile": ctx["clip_percentile_ch"]})
    return _add_shadow(rec, name, w, ctx, store)


# ---- smoothquant: per-channel smoothing s_j = max|X_j|^a / max|W_j|^(1-a), then per-tensor W8A8 ----

def build_smoothquant(name, w, ctx, store) -> dict:
    point = input_point(name)
    act_max = np.maximum(ctx["act_max"][point].astype(np.float64), 1e-5)
    w_max = np.maximum(ctx["w_max"][point], 1e-5)  # over every linear that reads this input
    a = ctx["alpha"]
    s = (act_max ** a / w_max ** (1 - a)).astype(np.float32)
    ws = w * s[None, :]
    sw = _w_scale(ws)
    clip = float((act_max / s).max())  # SmoothQuant: static per-tensor scale from the smoothed max
    return record("smoothquant", {"shape": list(w.shape), "wt": store.put(quantize_per_tensor(ws.T, sw), "weight"),
                                  "smooth": store.put(s, "smooth-scales"), "scale_w": sw, "scale_a": clip / 127.0,
                                  "alpha": a})


# ---- llm-int8: outlier feature columns (|x| > 6) in float, the rest int8 vector-wise ---------------

def build_llm_int8(name, w, ctx, store) -> dict:
    sw = np.maximum(np.abs(w).max(axis=1), 1e-12).astype(np.float32) / 127.0
    wq = np.clip(np.rint(w / sw[:, None]), -127, 127).astype(np.int8)
    return record("llm-int8", {"shape": list(w.shape), "wt": store.put(np.ascontiguousarray(wq.T), "weight"),
                               "scale_w_rows": store.put(sw, "weight-scales"), "threshold": ctx["int8_threshold"]})


# ---- q4_0: ggml Q4_0 groups of 32 along K, W4A16 ---------------------------------------------------

def build_q4_0(name, w, ctx, store) -> dict:
    import gguf

    N, K = w.shape
    Kp = -(-K // GROUP) * GROUP
    wp = np.zeros((N, Kp), np.float32)
    wp[:, :K] = w
    blocks = gguf.quants.quantize(wp, gguf.GGMLQuantizationType.Q4_0)  # uint8[N, Kp/32 * 18]
    return record("q4_0", {"shape": [N, K], "padded_k": Kp, "blocks": store.put(blocks, "weight")})


# ---- q4_0-tile: HMX tile layout, then tile-group Q4_0 (NPU test-time scaling §5.1) -----------------

def build_q4_0_tile(name, w, ctx, store) -> dict:
    N, K = w.shape
    return record("q4_0-tile", {"shape": [N, K], "tile": TILE, "padded": [padded(K), padded(N)],
                                "padding": padded(K) != K or padded(N) != N,
                                "blocks": store.put(quantize_tiles(w), "weight")})


# ---- moe-mixed: per-expert INT2/4/8 widths, per-channel linear quantization (EdgeMoE §3.2) ----------

def build_moe_mixed(name, w, ctx, store) -> dict:
    """Experts at the width ctx["expert_bits"][name] chose (INT2/4/8); every other linear at INT8."""
    bits = int(ctx["expert_bits"].get(name, ctx.get("other_bits", 8)))
    codes, scales = quantize_channels(w, bits)
    return record("moe-mixed", {"shape": list(w.shape), "bits": bits, "codes": store.put(codes, "weight"),
                                "scales": store.put(scales, "weight-scales")})


# Scheme names are a contract (CLI, manifests): add, never rename.
SCHEMES = {
    "float": (build_float, RUNNERS["float"]),
    "w8a8": (build_w8a8, RUNNERS["w8a8"]),
    "w8a8-shadow": (build_shadow, RUNNERS["w8a8-shadow"]),
    "w8a8c-shadow": (build_channel_shadow, RUNNERS["w8a8c-shadow"]),
    "smoothquant": (build_smoothquant, RUNNERS["smoothquant"]),
    "llm-int8": (build_llm_int8, RUNNERS["llm-int8"]),
    "q4_0": (build_q4_0, RUNNERS["q4_0"]),
    "q4_0-tile": (build_q4_0_tile, RUNNERS["q4_0-tile"]),
    "moe-mixed": (build_moe_mixed, RUNNERS["moe-mixed"]),
}
NEEDS_PROFILE = {"w8a8", "w8a8-shadow", "w8a8c-shadow", "smoothquant"}
MOE_ONLY = {"moe-mixed"}
