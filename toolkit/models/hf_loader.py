"""Load a Llama-family Hugging Face folder (config.json, *.safetensors, tokenizer.json).

Tensors are renamed to GGUF's names and Q/K rows are permuted from Hugging Face's "halves" RoPE
layout to the "adjacent pairs" layout, exactly as llama.cpp's converter does, so the one forward
pass serves both formats. As that converter does too, Gemma's norm weights w (Hugging Face computes
x * (1 + w)) are stored as 1 + w, and Phi-3's fused qkv_proj and gate_up_proj are split into Q, K, V
and gate, up.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..errors import ModelFormatError, UnsupportedModelError
from .config import ModelConfig, check_ffn_shapes, fused_rows
from .model import Model
from .tokenizer import Tokenizer
from .weights import LazyWeights, file_sha256

# model_type -> the architecture its config.json names: every one parses to a ModelConfig, so the template, cost
# models and schedules work from its config.json alone
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "internlm2": "InternLM2ForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
# those whose safetensors this loader reads: InternLM2 (HeteroLLM's InternLM-1.8B) plans from its config only (its
# fused wqkv tensor is not read yet)
WEIGHT_MODEL_TYPES = tuple(t for t in SUPPORTED_MODEL_TYPES if t != "internlm2")
GEMMA_TYPES = ("gemma2", "gemma3_text")
_ARCH_NAME = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}  # the others run as "llama" always did
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

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
# Gemma 2/3 norm four times a layer: post_attention_layernorm is the attention output's norm there, not the FFN's
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# Mixtral's experts: block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down), stacked per layer.
_EXPERT_NAMES = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_EXPERT_PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def gguf_name(hf_name: str, model_type: str = "llama") -> str | None:
    """Hugging Face tensor name -> GGUF tensor name (None for tensors the forward pass ignores).

    A Mixtral expert tensor maps to "<stacked GGUF name>.<expert>", e.g. "blk.0.ffn_up_exps.3".
    """
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model.layers.{i}.rest
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        return None
    rest = parts[3]
    names = _GEMMA_LAYER_NAMES if model_type in GEMMA_TYPES else _LAYER_NAMES
    if rest in names:
        return f"blk.{parts[2]}.{names[rest]}"
    if rest == "block_sparse_moe.gate.weight":
        return f"blk.{parts[2]}.ffn_gate_inp.weight"
    if rest == "mlp.gate.weight":  # Qwen3-MoE's router
        return f"blk.{parts[2]}.ffn_gate_inp.weight"
    sub = rest.split(".")  # block_sparse_moe.experts.{e}.w1.weight, mlp.experts.{e}.gate_proj.weight (Qwen3-MoE)
    if len(sub) == 5 and sub[:2] == ["block_sparse_moe", "experts"] and sub[3] in _EXPERT_NAMES and sub[4] == "weight":
        return f"blk.{parts[2]}.{_EXPERT_NAMES[sub[3]]}.{sub[2]}"
    if len(sub) == 5 and sub[:2] == ["mlp", "experts"] and sub[3] in _EXPERT_PROJ and sub[4] == "weight":
        return f"blk.{parts[2]}.{_EXPERT_PROJ[sub[3]]}.{sub[2]}"
    return None


def fused_parts(hf_name: str, cfg: ModelConfig) -> list[tuple[str, int, int]] | None:
    """Phi-3's fused projections -> [(GGUF name, first row, rows)]: qkv_proj holds Q, K, V's rows in that order,
    gate_up_proj gate's then up's (None for any other tensor)."""
    parts = hf_name.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        return None
    what = {"self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up"}.get(parts[3])
    return fused_rows(cfg, f"blk.{parts[2]}", what) if what else None


def _plus_one(w: np.ndarray) -> np.ndarray:
    """Gemma's norm weight as the forward pass multiplies by it: HF's Gemma RMSNorm computes x * (1 + w)."""
    return w + np.float32(1.0)


def _chain(*fns):
    """The composition of the transforms that are not None, applied left to right (None if there are none)."""
    fns = [f for f in fns if f is not None]
    if not fns:
        return None

    def run(w):
        for f in fns:
            w = f(w)
        return w
    return run


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


def _rope(cfg: dict, layer_type: str = "full_attention") -> dict:
    """RoPE settings, whether nested (transformers >= 5: rope_parameters, Gemma 3's one per layer type) or flat
    (rope_theta, rope_scaling)."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):  # Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}
        params = params[layer_type]
    elif any(isinstance(v, dict) for v in params.values()):
        params = {}  # another layer type asked of a per-type dict: its caller falls back to the flat keys
    flat = {k: v for k, v in (cfg.get("rope_scaling") or {}).items() if not isinstance(v, dict)}
    return dict(flat, **params)


def _window_layout(model_type: str, cfg: dict, n_layers: int) -> dict:
    """Sliding-window attention as ModelConfig states it (sliding_window, swa_pattern: every swa_pattern-th layer
    global). Gemma 2 alternates local and global layers, Gemma 3 has five local to one global; Mistral and Phi-3
    window every layer, which a pattern longer than the model says (no layer index reaches a global slot)."""
    window = int(cfg.get("sliding_window") or 0)
    if not window:
        return {}
    if model_type in GEMMA_TYPES:
        types = cfg.get("layer_types")
        full = [t == "full_attention" for t in types or ()]
        if any(full):  # transformers >= 5 lists the layers' types: the first global layer gives the pattern
            pattern = full.index(True) + 1
        else:
            pattern = len(full) + 1 if full else int(cfg.get("sliding_window_pattern")
                                                     or cfg.get("_sliding_window_pattern")
                                                     or (2 if model_type == "gemma2" else 6))
        if types and full != [(i + 1) % pattern == 0 for i in range(len(types))]:
            raise UnsupportedModelError(f"layer_types {types[:8]}... is not an every-{pattern}th-layer-global "
                                        "pattern; only that layout of local and global layers is implemented")
        return {"sliding_window": window, "swa_pattern": pattern}
    if model_type in ("mistral", "mixtral", "phi3"):
        return {"sliding_window": window, "swa_pattern": n_layers + 1}
    if cfg.get("use_sliding_window"):  # Qwen: the window is off unless use_sliding_window says otherwise
        raise UnsupportedModelError(f"model_type {model_type!r} with use_sliding_window is not supported; "
                                    "set use_sliding_window false or use full attention")
    return {}


def architecture_of(cfg: dict) -> str:
    """The architecture a config.json names (its first `architectures` entry), else its model_type."""
    archs = cfg.get("architectures") or []
    return str(archs[0]) if archs else str(cfg.get("model_type"))


def check_architecture(cfg: dict, path) -> str:
    """model_type of a supported architecture, or UnsupportedModelError naming it and the supported ones (one line)."""
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    raise UnsupportedModelError(
        f"{path}: architecture {architecture_of(cfg)!r} (model_type {model_type!r}) is not supported; supported: "
        + ", ".join(f"{a} ({t})" for t, a in ARCHITECTURES.items()))


def config_from_hf(cfg: dict, path: Path) -> ModelConfig:
    """config.json (a dict) -> ModelConfig for every architecture of ARCHITECTURES; no weights needed."""
    model_type = check_architecture(cfg, path)
    gemma = model_type in GEMMA_TYPES
    rope = _rope(cfg)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    act = (cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh") if gemma else cfg.get(
        "hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{path}: FFN activation {act!r} is not supported; the forward pass implements "
                                    "SwiGLU with silu and GeGLU with gelu_pytorch_tanh")
    if model_type != "qwen2" and (cfg.get("attention_bias") or (model_type == "internlm2" and cfg.get("bias"))):
        raise UnsupportedModelError(f"{path}: attention_bias (biases on every attention projection, output included) "
                                    "is not supported; Qwen2's Q/K/V biases are")
    if model_type == "internlm2" and rope_type == "dynamic":
        rope_type = "default"  # dynamic NTK scaling changes RoPE only past the trained context; InternLM2 plans only
    if rope_type not in ("default", None, "llama3"):
        raise UnsupportedModelError(f"{path}: RoPE scaling {rope_type!r} is not supported yet; "
                                    "plain RoPE and Llama 3's ('llama3') are implemented")
    if float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
        raise UnsupportedModelError(f"{path}: partial_rotary_factor (RoPE on part of each head) is not supported")
    try:
        hidden, n_heads, n_layers = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(
            cfg["num_hidden_layers"])
        theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        factors = ()
        if rope_type == "llama3":
            from edgeprobe_kernels.llama_ops import llama3_freq_factors

            factors = tuple(llama3_freq_factors(head_dim, theta, float(rope["factor"]), float(rope["low_freq_factor"]),
                                                float(rope["high_freq_factor"]),
                                                int(rope["original_max_position_embeddings"])))
        extra = dict(_window_layout(model_type, cfg, n_layers), **_moe(model_type, cfg, path))
        if gemma:  # Gemma: embeddings times sqrt(hidden) (in float32, as the GGUF loader), norms after attn and FFN
            extra.update(embed_scale=float(np.sqrt(np.float32(hidden))), post_norms=True,
                         attn_scale=_attn_scale(cfg, head_dim),
                         attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
                         final_softcap=float(cfg.get("final_logit_softcapping") or 0.0))
            if model_type == "gemma3_text":
                local = _rope(cfg, "sliding_attention").get("rope_theta")
                extra["rope_theta_local"] = float(local or cfg.get("rope_local_base_freq") or 10000.0)
        return ModelConfig(
            arch=_ARCH_NAME.get(model_type, "llama"),
            n_layers=n_layers,
            hidden=hidden,
            ffn=int(cfg["intermediate_size"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=theta,
            rope_freq_factors=factors,
            attn_bias=model_type == "qwen2",  # Qwen2's Q/K/V always carry biases (its config has no switch)
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            act_fn=_ACTIVATIONS[act],
            rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),  # Gemma ties by default, the others do not
            name=str(cfg.get("_name_or_path") or path.name),
            **extra,
        )
    except KeyError as e:
        raise ModelFormatError(f"{path}/config.json lacks {e.args[0]!r}; it is not a complete "
                               f"{architecture_of(cfg)} config") from e


def _attn_scale(cfg: dict, head_dim: int) -> float:
    """Gemma's score scale 1/sqrt(query_pre_attn_scalar), 0 (Llama's 1/sqrt(head_dim)) where the two are equal."""
    scalar = float(cfg.get("query_pre_attn_scalar") or head_dim)
    return 0.0 if scalar == head_dim else scalar ** -0.5


def _moe(model_type: str, cfg: dict, path) -> dict:
    """Mixture-of-experts fields: Mixtral (intermediate_size is each expert's) and Qwen3-MoE (moe_intermediate_size;
    every layer sparse: mlp_only_layers empty, decoder_sparse_step 1)."""
    if model_type == "mixtral":
        moe = dict(n_experts=int(cfg.get("num_local_experts", 0)),
                   n_experts_used=int(cfg.get("num_experts_per_tok", 0)),
                   expert_ffn=int(cfg.get("intermediate_size", 0)), norm_topk=True)
        if moe["n_experts"] < 1:
            raise ModelFormatError(f"{path}/config.json: a mixtral config needs num_local_experts >= 1")
        return moe
    if model_type == "qwen3_moe":
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise UnsupportedModelError(f"{path}: dense layers among the MoE layers (mlp_only_layers, "
                                        "decoder_sparse_step) are not supported; every layer must be sparse")
        n_experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers >= 5 writes the latter
        return dict(n_experts=int(n_experts), n_experts_used=int(cfg["num_experts_per_tok"]),
                    expert_ffn=int(cfg["moe_intermediate_size"]), norm_topk=bool(cfg.get("norm_topk_prob", True)))
    return {}


def read_config_json(file: Path) -> dict:
    try:
        doc = json.loads(Path(file).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{file} is not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise ModelFormatError(f"{file} is not a config.json (a JSON object)")
    return doc


class _NoWeights:
    """The tokenizer and weights of a model known by its config.json alone: any use says, in one line, that the
    command needs the checkpoint (schedule and the template plan from the config; run, profile, quantize do not)."""

    def __init__(self, source: Path):
        self._source = source

    def error(self) -> ModelFormatError:
        return ModelFormatError(f"{self._source} is a config.json alone (no weights): `edgeprobe schedule` plans from "
                                "it; this command needs the checkpoint (a GGUF file or a folder with *.safetensors)")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise self.error()


class ConfigOnlyWeights(LazyWeights):
    """No tensors: every lookup raises the one-line error of _NoWeights."""

    def __init__(self, source: Path):
        super().__init__({}, None)
        self._none = _NoWeights(source)

    def __getitem__(self, name):
        raise self._none.error()

    def get(self, name, default=None):
        raise self._none.error()

    def materialize(self):
        raise self._none.error()


def load_config_only(file: Path, name: str = "") -> Model:
    """A Model from a config.json alone: config and template, no tokenizer or weights (meta format "config")."""
    file = Path(file)
    hf_cfg = read_config_json(file)
    cfg = config_from_hf(hf_cfg, file.parent)
    return Model(config=cfg, tokenizer=_NoWeights(file), weights=ConfigOnlyWeights(file), source=str(file),
                 sha256=file_sha256(file), name=name or cfg.name, meta={"format": "config"})


def is_config_only_folder(path: Path) -> bool:
    """A folder with a config.json and no weights (neither *.safetensors nor PyTorch *.bin / *.pt)."""
    return (path / "config.json").exists() and not any(
        next(path.glob(pattern), None) for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf"))


def load_hf_folder(path: Path, name: str = "") -> Model:
    path = Path(path)
    if is_config_only_folder(path):
        return load_config_only(path / "config.json", name=name)
    for need in ("config.json", "tokenizer.json"):
        if not (path / need).exists():
            raise ModelFormatError(f"{path} has no {need}; a Hugging Face model folder needs config.json, "
                                   "*.safetensors and tokenizer.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path} has no *.safetensors file; convert .bin checkpoints to safetensors first")
    hf_cfg = read_config_json(path / "config.json")
    cfg = config_from_hf(hf_cfg, path)
    model_type = hf_cfg["model_type"]
    if model_type not in WEIGHT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: {architecture_of(hf_cfg)} plans from its config.json (edgeprobe schedule) but its safetensors "
            f"are not loaded yet (weights load for {', '.join(ARCHITECTURES[t] for t in WEIGHT_MODEL_TYPES)})")
    gemma = model_type in GEMMA_TYPES
    loaders, shapes, experts = {}, {}, {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                keys = list(f.keys())
                key_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
        except Exception as e:
            raise ModelFormatError(f"{file} cannot be read as safetensors ({e}); it is truncated or corrupt") from e
        for key in keys:
            fused = fused_parts(key, cfg)
            if fused is not None:
                if key_shapes[key][0] != sum(n for _, _, n in fused):
                    raise ModelFormatError(f"{file}: {key} has {key_shapes[key][0]} rows, config.json implies "
                                           f"{sum(n for _, _, n in fused)}; the checkpoint and its config disagree")
                for g, r0, n in fused:
                    shapes[g] = (n, *key_shapes[key][1:])
                    rows = (lambda r0, n: lambda w: w[r0:r0 + n])(r0, n)
                    loaders[g] = _tensor_loader(file, key, _chain(rows, rope_layout_transform(g, cfg)))
                continue
            g = gguf_name(key, model_type)
            if g is None:
                continue
            if "_exps." in g:  # one expert of a stacked tensor
                base, _, e = g.rpartition(".")
                experts.setdefault(base + ".weight", {})[int(e)] = (file, key, key_shapes[key])
                continue
            shapes[g] = key_shapes[key]
            plus_one = _plus_one if gemma and g.endswith("norm.weight") else None
            loaders[g] = _tensor_loader(file, key, _chain(plus_one, rope_layout_transform(g, cfg)))
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

