"""Write a loaded model as GGUF with the `gguf` package's own writer (llama.cpp's tensor names and keys).

Used to give `tiny-moe` a GGUF copy that the same loader reads back, and to hand any model edgeprobe
can load to llama.cpp. Weights are written as they are held (float32 Q/K rows already in GGUF's
"adjacent pairs" RoPE layout), or as float16 with `dtype="f16"` (1-D tensors stay float32, as in
llama.cpp's converter).
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from ..errors import UnsupportedModelError
from .model import Model
from .tokenizer import Tokenizer


def _pre_tokenizer_name(tok: Tokenizer) -> str:
    """The llama.cpp `tokenizer.ggml.pre` name of a byte-level BPE tokenizer's pre-tokenizer."""
    pre = json.loads(tok.hf.to_str()).get("pre_tokenizer") or {}
    kinds = ([p.get("type") for p in pre.get("pretokenizers", [])] if pre.get("type") == "Sequence"
             else [pre.get("type")])
    if kinds == ["ByteLevel"]:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and pre["pretokenizers"][0].get("individual_digits"):
        return "smollm"
    raise UnsupportedModelError(f"the tokenizer's pre-tokenizer {kinds} has no llama.cpp name edgeprobe knows; "
                                "only byte-level BPE with or without per-digit splitting can be written to GGUF")


def _vocab(tok: Tokenizer) -> tuple[list[str], list[str], list[int]]:
    """tokens by id, merges as "a b" strings, GGUF token types (1 normal, 3 control)."""
    spec = json.loads(tok.hf.to_str())
    if spec["model"]["type"] != "BPE":
        raise UnsupportedModelError(f"tokenizer model {spec['model']['type']} cannot be written as GGUF 'gpt2' BPE")
    vocab = dict(spec["model"]["vocab"])
    special = {}
    for t in spec.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special[t["id"]] = True
    tokens = [""] * tok.vocab_size
    for text, i in vocab.items():
        if i < tok.vocab_size:
            tokens[i] = text
    if any(t == "" for t in tokens):
        raise UnsupportedModelError("the tokenizer's vocabulary has holes (ids without a token); cannot write GGUF")
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    types = [3 if special.get(i) else 1 for i in range(tok.vocab_size)]
    return tokens, merges, types


def add_llama_keys(w: gguf.GGUFWriter, *, context: int, hidden: int, n_layers: int, ffn: int, heads: int,
                   kv_heads: int, head_dim: int, rope_theta: float, rms_eps: float, vocab: int) -> None:
    """The hyperparameter keys a llama-family GGUF carries (llama.cpp's names), as our loader reads them back."""
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(vocab)


def add_bpe_tokenizer(w: gguf.GGUFWriter, tokens: list[str], merges: list[str], types: list[int], pre: str) -> None:
    """A byte-level BPE tokenizer as GGUF's "gpt2" model: pieces by id, merges, token types, pre-tokenizer name."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)


def write_gguf(model: Model, path, dtype: str = "f32") -> Path:
    """Write `model` to `path` as a GGUF file (architecture "llama", Mixtral-style experts if any)."""
    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', got {dtype!r}")
    c, tok = model.config, model.tokenizer
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name(model.name or c.name or path.stem)
    add_llama_keys(w, context=c.context_length, hidden=c.hidden, n_layers=c.n_layers,
                   ffn=c.expert_ffn if c.n_experts else c.ffn, heads=c.n_heads, kv_heads=c.n_kv_heads,
                   head_dim=c.head_dim, rope_theta=c.rope_theta, rms_eps=c.rms_eps, vocab=c.vocab_size)
    if c.n_experts:
        w.add_expert_count(c.n_experts)
        w.add_expert_used_count(c.n_experts_used)
        w.add_expert_weights_norm(c.norm_topk)
        if c.shared_expert_ffn:
            w.add_expert_shared_feed_forward_length(c.shared_expert_ffn)
    add_bpe_tokenizer(w, *_vocab(tok), _pre_tokenizer_name(tok))
    if tok.bos_id is not None:
        w.add_bos_token_id(tok.bos_id)
    if tok.eos_id is not None:
        w.add_eos_token_id(tok.eos_id)
    w.add_add_bos_token(tok.add_bos)
    for name in model.weights:
        arr = np.asarray(model.weights[name], np.float32)
        if dtype == "f16" and arr.ndim > 1:
            arr = arr.astype(np.float16)
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return path
