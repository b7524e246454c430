"""Every architecture edgeprobe names loads its weights from a Hugging Face folder and runs as transformers does.

Each case builds a 2-layer model in transformers with the head shapes of a real checkpoint (head_dim, query and KV
heads from tests/data/configs where one is stored; hidden, FFN, experts and vocabulary shrunk), random float32
weights, saves it with save_pretrained (safetensors) beside a word-level tokenizer.json, loads the folder with
edgeprobe.models.load and compares the forward pass's logits with transformers' on the same token ids.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch  # the test extra installs both: a missing one fails, never skips
import transformers

from edgeprobe import models
from edgeprobe.forward import KVCache, forward

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
HIDDEN, FFN, VOCAB, LAYERS, TOKENS = 128, 256, 512, 2, 12
WINDOW = 4  # sliding windows shrunk so that 12 tokens cross them
# token ids the models' configs name, inside the shrunk vocabulary
SPECIAL = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _heads(name: str) -> dict:
    """Query heads, KV heads and head_dim of a stored config.json."""
    j = json.loads((CONFIGS / name / "config.json").read_text())
    return dict(num_attention_heads=j["num_attention_heads"], num_key_value_heads=j["num_key_value_heads"],
                head_dim=j.get("head_dim") or j["hidden_size"] // j["num_attention_heads"])


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# model_type -> (transformers class prefix, config arguments beyond the shared ones)
CASES = {
    "llama": ("Llama", dict(_heads("llama-3.2-1b"), rope_parameters=LLAMA3_ROPE, max_position_embeddings=131072,
                            tie_word_embeddings=True)),
    # Mistral 7B's shapes (32 query heads, 8 KV heads, head_dim 128) with v0.1's sliding window
    "mistral": ("Mistral", dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=WINDOW)),
    "qwen2": ("Qwen2", dict(_heads("qwen2.5-3b"), rope_theta=1000000.0)),
    "qwen3": ("Qwen3", dict(_heads("qwen3-1.7b"), rope_theta=1000000.0)),
    "qwen3_moe": ("Qwen3Moe", dict(_heads("qwen3-30b-a3b"), num_experts=16, num_experts_per_tok=8,
                                   moe_intermediate_size=64, norm_topk_prob=True)),
    "mixtral": ("Mixtral", dict(_heads("mixtral-8x7b"), num_local_experts=8, num_experts_per_tok=2,
                                intermediate_size=128)),
    # gemma-3-270m's heads (4 query heads, 1 KV head, head_dim 256); local, then global layer
    "gemma3_text": ("Gemma3", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=256)),
    # the attention soft-cap shrunk from 50 so that it binds on random weights (the logits reach ~100: 30 binds);
    # query_pre_attn_scalar other than head_dim, as in Gemma 2 27B (hidden / heads = 144 with head_dim 128)
    "gemma2": ("Gemma2", dict(_heads("gemma-2-2b"), sliding_window=WINDOW, query_pre_attn_scalar=144,
                              attn_logit_softcapping=0.5, final_logit_softcapping=30.0)),
    # Phi-3-mini's head_dim 96 with Phi-3-medium's grouped KV heads (40 / 10 there)
    "phi3": ("Phi3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=96, sliding_window=WINDOW)),
}


# what each architecture's config must turn into (beyond the shapes every case checks)
EXPECT = {
    "llama": lambda c: len(c.rope_freq_factors) == c.head_dim // 2 and max(c.rope_freq_factors) == 32.0,
    "mistral": lambda c: (c.sliding_window, c.swa_pattern) == (WINDOW, LAYERS + 1),
    "qwen2": lambda c: c.attn_bias,
    "qwen3": lambda c: c.qk_norm,
    "qwen3_moe": lambda c: (c.n_experts, c.n_experts_used, c.expert_ffn, c.qk_norm) == (16, 8, 64, True),
    "mixtral": lambda c: (c.n_experts, c.n_experts_used, c.expert_ffn) == (8, 2, 128),
    "gemma3_text": lambda c: (c.qk_norm, c.post_norms, c.sliding_window, c.swa_pattern, c.rope_theta,
                              c.rope_theta_local, c.attn_scale, c.act_fn) == (True, True, WINDOW, 2, 1e6, 1e4, 0.0,
                                                                              "gelu_tanh"),
    "gemma2": lambda c: (c.qk_norm, c.post_norms, c.sliding_window, c.swa_pattern, c.attn_scale, c.attn_softcap,
                         c.final_softcap) == (False, True, WINDOW, 2, 144 ** -0.5, 0.5, 30.0),
    "phi3": lambda c: (c.sliding_window, c.swa_pattern, c.ffn) == (WINDOW, LAYERS + 1, FFN),
}


def _write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer.json: "t{i}" is token i."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models

    tok = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def _build(model_type: str, folder: Path, **overrides):
    """The transformers model of a case, random float32 weights, saved to `folder` with a tokenizer."""
    prefix, extra = CASES[model_type][0], dict(CASES[model_type][1], **overrides)
    cfg_cls = getattr(transformers, ("Gemma3Text" if prefix == "Gemma3" else prefix) + "Config")
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=extra.pop("intermediate_size", FFN),
                  num_hidden_layers=LAYERS, rms_norm_eps=1e-6, **SPECIAL, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, prefix + "ForCausalLM")(cfg).eval().float()
    gemma = model_type.startswith("gemma")
    with torch.no_grad():  # transformers initializes norms to 1 (Gemma: 0) and biases to 0: make every weight count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return model


@pytest.mark.parametrize("model_type", list(CASES))
def test_generated_checkpoint_runs_as_transformers_does(model_type, tmp_path):
    prefix, extra = CASES[model_type]
    ref_model = _build(model_type, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type

    m = models.load(tmp_path, cache_dir=None)
    c = m.config
    assert (c.n_layers, c.hidden, c.vocab_size, c.n_heads, c.n_kv_heads, c.head_dim) == (
        LAYERS, HIDDEN, VOCAB, extra["num_attention_heads"], extra["num_key_value_heads"], extra["head_dim"])
    assert EXPECT[model_type](c), c
    assert m.tokenizer.encode("t5 t300 t7").tolist()[-3:] == [5, 300, 7]
    ids = np.random.default_rng(1).integers(0, VOCAB, TOKENS)
    ours = forward(m, ids)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert ours.shape == ref.shape == (TOKENS, VOCAB)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    tol = 1e-5 * max(1.0, float(np.abs(ref).max()))
    assert np.abs(ours - ref).max() < tol
    # a prefill, then decode steps through the KV cache (one query row: the attention kernel's decode path)
    cache, prefill = KVCache(c), TOKENS - 4
    steps = [forward(m, ids[:prefill], cache=cache, logits="last")]
    steps += [forward(m, ids[t:t + 1], cache=cache, logits="last") for t in range(prefill, TOKENS)]
    assert np.abs(np.stack(steps) - ref[prefill - 1:]).max() < tol


# llama.cpp's converter (convert_hf_to_gguf.py) for the architectures whose GGUF layout differs from Llama's: Gemma's
# norms stored as 1 + w and four a layer, Phi-3's fused qkv_proj and gate_up_proj kept fused
_GGUF_LAYER = {
    "gemma2": {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"},
    "phi3": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def _write_gguf(model_type: str, ref_model, path: Path) -> None:
    """ref_model's weights as llama.cpp's converter writes them (float32), with the metadata llama.cpp reads."""
    import gguf

    cfg, arch = ref_model.config, model_type
    g = gguf.GGUFWriter(str(path), arch)
    for name, t in ref_model.state_dict().items():
        w = t.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{_GGUF_LAYER[arch][rest.removesuffix('.weight')]}.weight"
        elif name in _GGUF_GLOBAL and not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            gname = _GGUF_GLOBAL[name]
        else:
            continue
        if arch == "gemma2" and gname.endswith("norm.weight"):
            w = w + np.float32(1.0)
        g.add_tensor(gname, np.ascontiguousarray(w))
    g.add_block_count(cfg.num_hidden_layers)
    g.add_context_length(cfg.max_position_embeddings)
    g.add_embedding_length(cfg.hidden_size)
    g.add_feed_forward_length(cfg.intermediate_size)
    g.add_head_count(cfg.num_attention_heads)
    g.add_head_count_kv(cfg.num_key_value_heads)
    g.add_key_length(cfg.head_dim)
    g.add_value_length(cfg.head_dim)
    g.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    g.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    g.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        g.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        g.add_final_logit_softcapping(cfg.final_logit_softcapping)
    g.add_tokenizer_model("gpt2")
    g.add_token_list([f"t{i}" for i in range(VOCAB)])
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


# Gemma 2's GGUF carries no query_pre_attn_scalar (llama.cpp derives it from the model's size): 2B's, head_dim
@pytest.mark.parametrize("model_type,overrides", [("gemma2", {"query_pre_attn_scalar": 256}), ("phi3", {})])
def test_generated_gguf_runs_as_transformers_does(model_type, overrides, tmp_path):
    ref_model = _build(model_type, tmp_path / "hf", **overrides)
    path = tmp_path / f"{model_type}.gguf"
    _write_gguf(model_type, ref_model, path)
    m = models.load(path, cache_dir=None)
    c = m.config
    assert (c.arch, c.n_layers, c.hidden, c.ffn, c.n_heads, c.n_kv_heads, c.head_dim, c.sliding_window) == (
        model_type, LAYERS, HIDDEN, FFN, CASES[model_type][1]["num_attention_heads"],
        CASES[model_type][1]["num_key_value_heads"], CASES[model_type][1]["head_dim"], WINDOW)
    ids = np.random.default_rng(1).integers(0, VOCAB, TOKENS)
    ours = forward(m, ids)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(ours - ref).max() < 1e-5 * max(1.0, float(np.abs(ref).max()))


def test_gemma2_plans_carry_its_score_scale_and_soft_caps_to_the_agent(tmp_path):
    """The template's attention ops carry Gemma 2's score scale and soft-cap and its lm_head the logit soft-cap, so
    a plan the agent runs (its own ops, in-process here) gives the host pass's logits; without them it would not."""
    from edgeprobe.graph.local import run_plan
    from edgeprobe.plan import prefill_plan
    from edgeprobe.quant import quantize

    _build("gemma2", tmp_path)
    m = models.load(tmp_path, cache_dir=None)
    qm = quantize(m, "float")
    ids = np.random.default_rng(2).integers(0, VOCAB, TOKENS).astype(np.int32)
    plan = prefill_plan(qm.manifest, len(ids))
    attn = [op["attrs"] for op in plan["ops"] if op["kind"] == "attention"]
    head = next(op["attrs"] for op in plan["ops"] if op["kind"] == "lm_head")
    c = m.config
    assert len(attn) == LAYERS and all((a["scale"], a["softcap"]) == (c.attn_scale, c.attn_softcap) for a in attn)
    assert head["softcap"] == c.final_softcap > 0
    outs, _, _ = run_plan(plan, qm.store.get, {"tokens": ids})
    ref = forward(m, ids, logits="last")
    assert np.abs(outs["lm_head"][0] - ref).max() < 1e-5 * max(1.0, float(np.abs(ref).max()))
    for op in plan["ops"]:  # the same plan without them computes something else
        op["attrs"].pop("softcap", None)
    outs, _, _ = run_plan(plan, qm.store.get, {"tokens": ids})
    assert np.abs(outs["lm_head"][0] - ref).max() > 1e-2


def test_an_untied_head_is_quantized_once(tmp_path):
    """Mistral's lm_head is its own matrix: a scheme with a Q8_0 head keeps that head only, not also its float copy
    (2.1 GB of an 8B model's blobs), and the agent's plan runs without it."""
    from edgeprobe.graph.local import run_plan
    from edgeprobe.plan import prefill_plan
    from edgeprobe.quant import quantize

    _build("mistral", tmp_path)
    m = models.load(tmp_path, cache_dir=None)
    assert "output.weight" in m.weights
    qm = quantize(m, "q4_0")
    assert qm.manifest["head"] and "output.weight" not in qm.manifest["tensors"]
    assert "output.weight" in quantize(m, "float").manifest["tensors"]  # no Q8_0 head: the float one stays
    ids = np.random.default_rng(3).integers(0, VOCAB, TOKENS).astype(np.int32)
    outs, _, _ = run_plan(prefill_plan(qm.manifest, len(ids)), qm.store.get, {"tokens": ids})
    host = qm.forward(ids, logits="last")
    assert np.abs(outs["lm_head"][0] - host).max() < 1e-4 * max(1.0, float(np.abs(host).max()))
