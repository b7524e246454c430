"""ModelConfig: the architecture numbers the one forward pass needs, read from checkpoint metadata."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from ..errors import EdgeprobeError, ModelFormatError


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (dense or mixture-of-experts).

    `rope_pairs` says which dimensions RoPE rotates together: "adjacent" (2i, 2i+1), the GGUF /
    llama.cpp layout in which Q/K rows are stored permuted, or "halves" (i, i + d/2), the Hugging Face
    layout. The loaders convert to "adjacent", so the forward pass implements one convention.
    """

    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 2048
    act_fn: str = "silu"  # the FFN gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    rope_pairs: str = "adjacent"
    tie_embeddings: bool = True
    # Mixture-of-experts (0 experts = dense FFN); filled in by the MoE loaders.
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    norm_topk: bool = True
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False  # Qwen-MoE: shared expert scaled by sigmoid(ffn_gate_inp_shexp · x)
    # Gemma 3 (all read from the checkpoint; the defaults are Llama's): embeddings scaled by sqrt(hidden),
    # RMSNorm of each query / key head before RoPE, norms after attention and after the FFN too, and
    # sliding-window attention on local layers (every `swa_pattern`-th layer global) with their own RoPE base.
    embed_scale: float = 1.0
    qk_norm: bool = False
    post_norms: bool = False
    sliding_window: int = 0
    swa_pattern: int = 0
    rope_theta_local: float = 0.0
    # Gemma: attention scores times attn_scale (1/sqrt(query_pre_attn_scalar); 0: Llama's 1/sqrt(head_dim)); Gemma 2
    # soft-caps them and the final logits: s -> tanh(s / cap) * cap (0: no cap)
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Qwen2: biases on the Q/K/V projections; Llama 3: RoPE frequency divisors (rope_freqs / rope_scaling llama3)
    attn_bias: bool = False
    rope_freq_factors: tuple = ()
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "rope_freq_factors", tuple(float(f) for f in self.rope_freq_factors))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_experts and not 1 <= self.n_experts_used <= self.n_experts:
            raise ModelFormatError(f"{self.name or 'model'}: top-k = {self.n_experts_used} experts per token, but "
                                   f"the model has {self.n_experts} experts; top-k must be between 1 and "
                                   f"{self.n_experts} (fix num_experts_per_tok / expert_used_count)")
        if self.n_experts and not self.expert_ffn:
            object.__setattr__(self, "expert_ffn", self.ffn)  # Mixtral: intermediate_size is the expert's

    def is_local(self, layer: int) -> bool:
        """Does `layer` attend over a sliding window (Gemma 3: all but every swa_pattern-th layer)?"""
        return bool(self.sliding_window and self.swa_pattern and (layer + 1) % self.swa_pattern)

    def window(self, layer: int) -> int:
        """Keys a query of `layer` may see, itself included (0: every earlier position)."""
        return self.sliding_window if self.is_local(layer) else 0

    def theta(self, layer: int) -> float:
        """RoPE base of `layer` (local layers may have their own)."""
        return self.rope_theta_local if self.is_local(layer) and self.rope_theta_local else self.rope_theta

    @property
    def group(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention (Q/K/V biases of Qwen2 included), FFN or experts with their
        router and shared expert, norms."""
        h, f, d = self.hidden, self.ffn, self.head_dim
        attn = h * d * (self.n_heads * 2 + self.n_kv_heads * 2)
        if self.attn_bias:
            attn += d * (self.n_heads + 2 * self.n_kv_heads)
        if self.n_experts:
            ff = self.n_experts * 3 * h * (self.expert_ffn or f) + h * self.n_experts
            ff += 3 * h * self.shared_expert_ffn + (h if self.shared_expert_gate else 0)
        else:
            ff = 3 * h * f
        return attn + ff + 2 * h + (2 * h if self.post_norms else 0) + (2 * d if self.qk_norm else 0)

    def n_params(self) -> int:
        """Parameter count, embeddings included once when tied."""
        emb = self.vocab_size * self.hidden * (1 if self.tie_embeddings else 2)
        return self.n_layers * self.layer_params() + emb + self.hidden

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


class MemoryLimitError(EdgeprobeError, MemoryError):
    """A pass whose one layer and activations do not fit the memory limit (refused before it starts)."""


MEMORY_LIMIT_ENV = "EDGEPROBE_MEMORY_LIMIT"
WEIGHT_BYTES = 4  # the pass holds a layer's weights dequantized to float32 (models.weights.LazyWeights)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def layer_bytes(cfg: ModelConfig) -> int:
    """Bytes of one decoder layer's weights as a pass holds them: layer_params() float32 numbers."""
    return WEIGHT_BYTES * cfg.layer_params()


def activation_bytes(cfg: ModelConfig, window: int, logits: bool = False, windows_held: int = 1) -> int:
    """An upper bound on the float32 activations a pass over windows of `window` tokens holds inside one layer:
    per token the residual stream, its norm and the layer's output (3 x hidden), Q, K, V and the attention output
    ((2 n_heads + 2 n_kv_heads) x head_dim), the scores and their softmax (2 x n_heads x window), and the FFN's
    gate, up and product (3 x ffn; MoE: the k routed experts' rows, the shared expert and the router logits).
    logits: the LM head's float32[window, vocab] and perplexity's exp copy of it. windows_held: windows whose
    hidden states float32[window, hidden] are held besides the one in the layer (a layer-major pass)."""
    h, d, T = cfg.hidden, cfg.head_dim, int(window)
    if cfg.n_experts:
        f = cfg.n_experts_used * (cfg.expert_ffn or cfg.ffn) + cfg.shared_expert_ffn + cfg.n_experts
    else:
        f = cfg.ffn
    per_token = 3 * h + 2 * (cfg.n_heads + cfg.n_kv_heads) * d + 2 * cfg.n_heads * T + 3 * f
    per_token += 2 * cfg.vocab_size if logits else 0
    return 4 * T * per_token + 4 * (int(windows_held) - 1) * T * h


def parse_bytes(text: str) -> int:
    """'8G', '512MiB', '1.5 GB', '1000000' -> bytes (units are powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise MemoryLimitError(f"{MEMORY_LIMIT_ENV}={text!r} is not a size; give bytes or a number with K, M, G or T "
                               "(powers of 1024), e.g. 8G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def memory_limit() -> tuple[int | None, str]:
    """(bytes a pass may use, where that came from): $EDGEPROBE_MEMORY_LIMIT, else MemAvailable in /proc/meminfo,
    else (None, ...) where neither exists (no check)."""
    env = os.environ.get(MEMORY_LIMIT_ENV)
    if env:
        return parse_bytes(env), MEMORY_LIMIT_ENV
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    return None, "no /proc/meminfo"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def fits(cfg: ModelConfig, window: int, logits: bool = False, windows: int = 1) -> bool:
    """Whether `windows` windows computed at once (side by side, each inside one layer) fit under memory_limit():
    one layer's weights plus each window's activations (activation_bytes); True where the limit is unknown."""
    limit = memory_limit()[0]
    return limit is None or layer_bytes(cfg) + int(windows) * activation_bytes(cfg, window, logits) <= limit


def check_fits(cfg: ModelConfig, window: int, what: str = "pass", logits: bool = False,
               windows_held: int = 1, name: str = "") -> dict:
    """Refuse (MemoryLimitError, one line with the numbers) a pass whose one layer's weights plus its activations
    (layer_bytes, activation_bytes) exceed memory_limit(), before any work: the OOM killer gives no message.
    Returns {"layer_bytes", "activation_bytes", "limit", "limit_source"} when it fits (limit None: unknown)."""
    lb, ab = layer_bytes(cfg), activation_bytes(cfg, window, logits, windows_held)
    limit, source = memory_limit()
    if limit is not None and lb + ab > limit:
        err = MemoryLimitError(
            f"{name or cfg.name or cfg.arch}: the {what} needs one layer's float32 weights ({_mib(lb)}) plus "
            f"activations over a window of {window} tokens ({_mib(ab)}) = {_mib(lb + ab)}, more than the limit of "
            f"{_mib(limit)} ({source}); free memory, use a smaller --window, or set {MEMORY_LIMIT_ENV} (e.g. 8G) "
            "if more is free")
        err.layer_bytes, err.activation_bytes, err.limit, err.limit_source = lb, ab, limit, source
        raise err
    return {"layer_bytes": lb, "activation_bytes": ab, "limit": limit, "limit_source": source}


def fused_rows(cfg: ModelConfig, blk: str, what: str) -> list[tuple[str, int, int]]:
    """Phi-3's fused projections of layer `blk` ("blk.{i}") -> [(GGUF name, first row, rows)]: "qkv" holds Q, K and
    V's rows in that order, "gate_up" gate's then up's (Hugging Face's qkv_proj / gate_up_proj, llama.cpp's attn_qkv /
    ffn_up)."""
    if what == "qkv":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return [(f"{blk}.attn_q.weight", 0, q), (f"{blk}.attn_k.weight", q, kv), (f"{blk}.attn_v.weight", q + kv, kv)]
    return [(f"{blk}.ffn_gate.weight", 0, cfg.ffn), (f"{blk}.ffn_up.weight", cfg.ffn, cfg.ffn)]


def check_ffn_shapes(cfg: ModelConfig, shapes: dict, path) -> None:
    """Router and expert tensors must agree with each other and the config (GGUF names, [out, in])."""
    if not cfg.n_experts:
        return
    E, h, f = cfg.n_experts, cfg.hidden, cfg.expert_ffn
    want = {"ffn_gate_inp": (E, h), "ffn_gate_exps": (E, f, h), "ffn_up_exps": (E, f, h), "ffn_down_exps": (E, h, f)}
    if cfg.shared_expert_ffn:
        s = cfg.shared_expert_ffn
        want.update({"ffn_gate_shexp": (s, h), "ffn_up_shexp": (s, h), "ffn_down_shexp": (h, s)})
        if cfg.shared_expert_gate:
            want["ffn_gate_inp_shexp"] = (1, h)
    for i in range(cfg.n_layers):
        for t, shape in want.items():
            name = f"blk.{i}.{t}.weight"
            if name not in shapes:
                raise ModelFormatError(f"{path}: tensor {name} is missing; an MoE layer needs a router "
                                       "(ffn_gate_inp) and stacked experts (ffn_gate/up/down_exps)")
            if tuple(shapes[name]) != shape:
                raise ModelFormatError(
                    f"{path}: tensor {name} has shape {tuple(shapes[name])} but {shape} is implied by {E} experts, "
                    f"hidden {h} and expert FFN {f}; the router and expert shapes disagree with each other or "
                    "with the config")


# schemes a config alone can be planned under: their records are the template's stand-ins (no profile, no blobs).
# Every scheme's bytes and op kinds follow from the shapes alone; what depends on the weights (clips, which layers
# keep shadow outliers, expert bit widths) is stood in for, and the plan says so (`planned.priced_from`)
PLANNED_SCHEMES = ("float", "w8a8", "w8a8-shadow", "w8a8c-shadow", "smoothquant", "llm-int8", "q4_0", "q4_0-tile",
                   "moe-mixed")
EXACT_FROM_CONFIG = ("float", "w8a8", "q4_0", "q4_0-tile")  # nothing of theirs depends on the weights' values


def plan_manifest(cfg: ModelConfig, scheme: str = "w8a8-shadow", prune_rate: float = 0.85) -> dict:
    """What schedule.predicted_schedule and graph.template.Weights.of read from a QuantizedModel's manifest, made
    from a config alone (planning before the weights are downloaded): the config and the scheme's stand-in records.

    Linears cost 1 byte per weight (w8a8, w8a8-shadow) or 4 (float), the LM head Q8_0 when quantized, as
    quant.quantize writes them. w8a8-shadow keeps the shadow-outlier GEMMs of (1 - prune_rate) of the layers
    (mllm-NPU prunes the 85% least important); which layers needs a profile of the weights, so the kept ones are
    spread evenly over the depth. MoE models plan as float: the quantizer's w8a8 schemes need activation
    statistics inside experts, which it does not collect (quant.qmodel.quantize refuses them too)."""
    if scheme not in PLANNED_SCHEMES:
        raise ModelFormatError(f"scheme {scheme!r} cannot be planned from a config alone; choose one of "
                               f"{', '.join(PLANNED_SCHEMES)}")
    if scheme == "moe-mixed" and not cfg.n_experts:
        raise ModelFormatError(f"scheme 'moe-mixed' sets the bit widths of experts, and {cfg.name or 'this model'} "
                               "is dense: choose another scheme")
    L = cfg.n_layers
    keep = L - int(np.floor(prune_rate * L)) if scheme in ("w8a8-shadow", "w8a8c-shadow") else 0
    shadow = sorted({int(i * L // keep) for i in range(keep)}) if keep else []
    exact = scheme in EXACT_FROM_CONFIG
    return {"config": dataclasses.asdict(cfg), "scheme": scheme,
            "model": {"name": cfg.name, "sha256": None},
            "planned": {"scheme": scheme, "shadow": shadow, "floats": scheme == "float",
                        "q8_head": scheme != "float" and cfg.hidden % 32 == 0, "prune_rate": prune_rate,
                        "priced_from": "shapes and bytes" if exact else
                        "shapes and bytes; what depends on the weights (" + WEIGHT_DEPENDENT[scheme] + ") stood in"}}


WEIGHT_DEPENDENT = {"w8a8-shadow": "which layers keep shadow outliers: spread evenly over the depth",
                    "w8a8c-shadow": "which layers keep shadow outliers: spread evenly over the depth",
                    "smoothquant": "the smoothing scales: their bytes only",
                    "llm-int8": "the outlier columns: none priced",
                    "moe-mixed": "each expert's bit width: INT4 for every expert (EdgeMoE's default width)"}
