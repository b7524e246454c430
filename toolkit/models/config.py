"""ModelConfig: the architecture numbers the one forward pass needs, read from checkpoint metadata."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


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
    act_fn: str = "silu"  # the FFN gate activation; the forward pass implements SwiGLU (silu)
    rope_pairs: str = "adjacent"
    tie_embeddings: bool = True
    # Mixture-of-experts (0 experts = dense FFN); filled in by the MoE loaders.
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    norm_topk: bool = True
    shared_expert_ffn: int = 0
    name: str = ""

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def group(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def n_params(self) -> int:
        """Parameter count, embeddings included once when tied."""
        h, f, d = self.hidden, self.ffn, self.head_dim
        attn = h * d * (self.n_heads * 2 + self.n_kv_heads * 2)
        if self.n_experts:
            ff = self.n_experts * 3 * h * (self.expert_ffn or f) + h * self.n_experts
            ff += 3 * h * self.shared_expert_ffn
        else:
            ff = 3 * h * f
        per_layer = attn + ff + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + h

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)
