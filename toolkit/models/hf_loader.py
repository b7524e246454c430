"""Load a Llama-family Hugging Face folder (config.json, *.safetensors, tokenizer.json).

Tensors are renamed to GGUF's names and Q/K rows are permuted from Hugging Face's "halves" RoPE
layout to the "adjacent pairs" layout, exactly as llama.cpp's converter does, so the one forward
pass serves both formats.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..errors import ModelFormatError, UnsupportedModelError
from .config import ModelConfig, check_ffn_shapes
from .model import Model
from .tokenizer import Tokenizer
from .weights import LazyWeights, file_sha256

SUPPORTED_MODEL_TYPES = ("llama", "mixtral", "qwen2", "qwen3")

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",          # Qwen2
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# Mixtral's experts: block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down), stacked per layer.
_EXPERT_NAMES = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def gguf_name(hf_name: str) -> str | None:
    """Hugging Face tensor name -> GGUF tensor name (None for tensors the forward pass ignores).

    A Mixtral expert tensor maps to "<stacked GGUF name>.<expert>", e.g. "blk.0.ffn_up_exps.3".
    """
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model.layers.{i}.rest
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        return None
    rest = parts[3]
    if rest in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[rest]}"
    if rest == "block_sparse_moe.gate.weight":
        return f"blk.{parts[2]}.ffn_gate_inp.weight"
    sub = rest.split(".")  # block_sparse_moe.experts.{e}.w1.weight
    if len(sub) == 5 and sub[:2] == ["block_sparse_moe", "experts"] and sub[3] in _EXPERT_NAMES and sub[4] == "weight":
        return f"blk.{parts[2]}.{_EXPERT_NAMES[sub[3]]}.{sub[2]}"
    return None


def halves_to_adjacent(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder Q/K output rows per head from (i, i+d/2) RoPE pairs to (2i, 2i+1) pairs.

    w: float32[n_heads*head_dim, hidden]. Row j < d/2 of a head moves to 2j, row d/2+j to 2j+1.
    """
    rows = w.shape[0]
    d = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, d // 2, -1).swapaxes(1, 2).reshape(rows, -1))


def rope_layout_transform(name: str, cfg: ModelConfig):
    """The reordering a Q/K tensor in the halves RoPE layout needs (rows, biases, per-head norms), or None."""
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        h = cfg.n_heads
    elif name.endswith(("attn_k.weight", "attn_k.bias")):
        h = cfg.n_kv_heads
    elif name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
        h = 1  # one head's worth of weights, shared by every head
    else:
        return None
    if name.endswith(".bias") or "_norm" in name:
        return lambda w: halves_to_adjacent(w[:, None], h)[:, 0]
    return lambda w: halves_to_adjacent(w, h)


def _read_bf16(path: Path, name: str) -> np.ndarray:
    """numpy has no bfloat16: read the raw tensor from the safetensors header and widen to float32."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    info = header[name]
    start, end = info["data_offsets"]
    raw = np.memmap(path, dtype=np.uint16, mode="r", offset=8 + n + start, shape=((end - start) // 2,))
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def _read_tensor(path: Path, name: str) -> np.ndarray:
    with safe_open(str(path), framework="numpy") as f:
        dtype = f.get_slice(name).get_dtype()
        arr = _read_bf16(path, name) if dtype == "BF16" else f.get_tensor(name)
    return np.asarray(arr, dtype=np.float32)


def _tensor_loader(path: Path, name: str, transform=None):
    def load() -> np.ndarray:
        arr = _read_tensor(path, name)
        return transform(arr) if transform else arr
    return load


def _stacked_loader(parts: list[tuple[Path, str]]):
    """Experts stored one tensor each -> float32[E, out, in], as GGUF's ffn_*_exps tensors hold them."""
    return lambda: np.stack([_read_tensor(p, n) for p, n in parts])


def config_from_hf(cfg: dict, path: Path) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"{path}: model_type {model_type!r} is not supported "
                                    f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use a Llama-family model "
                                    "or a Mixtral-layout MoE")
    moe = {}
    if model_type == "mixtral":
        moe = dict(n_experts=int(cfg.get("num_local_experts", 0)),
                   n_experts_used=int(cfg.get("num_experts_per_tok", 0)),
                   expert_ffn=int(cfg.get("intermediate_size", 0)), norm_topk=True)
        if moe["n_experts"] < 1:
            raise ModelFormatError(f"{path}/config.json: a mixtral config needs num_local_experts >= 1")
    # transformers >= 5 nests RoPE settings in rope_parameters; older configs use rope_theta/rope_scaling.
    rope = dict(cfg.get("rope_scaling") or {}, **(cfg.get("rope_parameters") or {}))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{path}: FFN activation {cfg['hidden_act']!r} is not supported; "
                                    "the forward pass implements SwiGLU with silu")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{path}: attention_bias (biases on every attention projection, output included) "
                                    "is not supported; Qwen2's Q/K/V biases are")
    if rope_type not in ("default", None, "llama3"):
        raise UnsupportedModelError(f"{path}: RoPE scaling {rope_type!r} is not supported yet; "
                                    "plain RoPE and Llama 3's ('llama3') are implemented")
    try:
        hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        factors = ()
        if rope_type == "llama3":
            from edgeprobe_kernels.llama_ops import llama3_freq_factors

            factors = tuple(llama3_freq_factors(head_dim, theta, float(rope["factor"]), float(rope["low_freq_factor"]),
                                                float(rope["high_freq_factor"]),
                                                int(rope["original_max_position_embeddings"])))
        return ModelConfig(
            arch="llama",
            n_layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            ffn=int(cfg["intermediate_size"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=theta,
            rope_freq_factors=factors,
            attn_bias=model_type == "qwen2",  # Qwen2's Q/K/V always carry biases (its config has no switch)
            qk_norm=model_type == "qwen3",
            rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            name=str(cfg.get("_name_or_path") or path.name),
            **moe,
        )
    except KeyError as e:
        raise ModelFormatError(f"{path}/config.json lacks {e.args[0]!r}; it is not a complete Llama config") from e


def load_hf_folder(path: Path, name: str = "") -> Model:
    path = Path(path)
    for need in ("config.json", "tokenizer.json"):
        if not (path / need).exists():
            raise ModelFormatError(f"{path} has no {need}; a Hugging Face model folder needs config.json, "
                                   "*.safetensors and tokenizer.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path} has no *.safetensors file; convert .bin checkpoints to safetensors first")
    try:
        hf_cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path}/config.json is not valid JSON ({e})") from e
    cfg = config_from_hf(hf_cfg, path)
    loaders, shapes, experts = {}, {}, {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                keys = list(f.keys())
                key_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
        except Exception as e:
            raise ModelFormatError(f"{file} cannot be read as safetensors ({e}); it is truncated or corrupt") from e
        for key in keys:
            g = gguf_name(key)
            if g is None:
                continue
            if "_exps." in g:  # one expert of a stacked tensor
                base, _, e = g.rpartition(".")
                experts.setdefault(base + ".weight", {})[int(e)] = (file, key, key_shapes[key])
                continue
            shapes[g] = key_shapes[key]
            transform = None
            transform = rope_layout_transform(g, cfg)
            loaders[g] = _tensor_loader(file, key, transform)
    for tname, by_e in experts.items():
        if sorted(by_e) != list(range(cfg.n_experts)):
            raise ModelFormatError(f"{path}: {tname} has experts {sorted(by_e)[:10]}, config.json says "
                                   f"num_local_experts = {cfg.n_experts}; the checkpoint and its config disagree")
        parts = [by_e[e] for e in range(cfg.n_experts)]
        if len({p[2] for p in parts}) != 1:
            raise ModelFormatError(f"{path}: the experts of {tname} have different shapes "
                                   f"{sorted({p[2] for p in parts})}; the checkpoint is inconsistent")
        shapes[tname] = (cfg.n_experts, *parts[0][2])
        loaders[tname] = _stacked_loader([(p[0], p[1]) for p in parts])
    if cfg.tie_embeddings:
        loaders.pop("output.weight", None)
    missing = [n for n in ("token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight") if n not in loaders]
    if missing:
        raise ModelFormatError(f"{path}: tensors {missing} are missing; not a complete Llama checkpoint")
    check_ffn_shapes(cfg, shapes, path)
    eos = hf_cfg.get("eos_token_id")
    tok = Tokenizer.from_hf_folder(path, cfg.vocab_size, bos_id=hf_cfg.get("bos_token_id"),
                                   eos_id=eos[0] if isinstance(eos, list) else eos)
    digest = hashlib.sha256()
    for file in [path / "config.json", *files]:
        digest.update(file_sha256(file).encode())
    return Model(config=cfg, tokenizer=tok, weights=LazyWeights(loaders, None), source=str(path),
                 sha256=digest.hexdigest(), name=name or cfg.name, meta={"format": "hf"})
