"""Qwen2 (Q/K/V biases), Qwen3 (per-head q/k RMSNorm) and Llama 3 (RoPE scaling) through the one forward pass
and the one template: Hugging Face folders written from SmolLM2's real weights with each feature added,
loaded by transformers' own Qwen2 / Qwen3 / Llama classes and by edgeprobe, logits compared."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from edgeprobe import models
from edgeprobe.forward import forward

N_TOKENS = 48


@pytest.fixture(scope="module")
def base(one_gguf_parse):
    """SmolLM2's real weights in Hugging Face's layout (transformers reads the GGUF), 4 layers to keep it small."""
    path = models.resolve("smollm2-135m")
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    cfg = m.config.to_dict()
    cfg.pop("quantization_config", None)
    keep = lambda k: not k.startswith("model.layers.") or int(k.split(".")[2]) < 4
    state = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight" and keep(k)}
    cfg["num_hidden_layers"] = 4
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return state, cfg, tok


def _variant(tmp_path, base, model_type, arch, extra_cfg, extra_state):
    state, cfg, tok = base
    cfg = {**cfg, **extra_cfg, "model_type": model_type, "architectures": [arch]}
    folder = tmp_path / model_type
    folder.mkdir()
    save_file({**state, **extra_state(cfg)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(folder)
    return folder


def _compare(folder, ids):
    ref_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    m = models.load(folder)
    ours = forward(m, ids)
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    err = float(np.abs(ours - ref).max())
    print(f"{folder.name}: top-1 {top1:.3f}, max |Δlogit| {err:.2e}")
    assert top1 >= 0.99 and err < 1e-3 * max(1.0, float(np.abs(ref).max()))
    return m, ours


def _plan_matches(m, ids, ours):
    """The template's ops for the variant, run in-process, give the forward pass's logits."""
    from edgeprobe.graph.local import run_plan
    from edgeprobe.plan import prefill_plan
    from edgeprobe.quant import quantize

    qm = quantize(m, "float")
    outs, _, _ = run_plan(prefill_plan(qm.manifest, len(ids)), qm.store.get, {"tokens": ids.astype(np.int32)})
    assert np.abs(outs["lm_head"][0] - ours[-1]).max() < 1e-3


def test_qwen2_biases(tmp_path, base, heldout_ids):
    rng = np.random.default_rng(0)

    def biases(cfg):
        h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg["hidden_size"] // h
        return {f"model.layers.{i}.self_attn.{p}_proj.bias": torch.tensor(rng.normal(size=n) * 0.5, dtype=torch.float32)
                for i in range(cfg["num_hidden_layers"]) for p, n in (("q", h * d), ("k", kv * d), ("v", kv * d))}
    folder = _variant(tmp_path, base, "qwen2", "Qwen2ForCausalLM", {"use_sliding_window": False}, biases)
    ids = heldout_ids[:N_TOKENS]
    m, ours = _compare(folder, ids)
    assert m.config.attn_bias and not m.config.qk_norm
    _plan_matches(m, ids, ours)


def test_qwen3_qk_norms(tmp_path, base, heldout_ids):
    rng = np.random.default_rng(1)

    def norms(cfg):
        d = cfg["hidden_size"] // cfg["num_attention_heads"]
        norm = lambda: torch.tensor(1 + 0.3 * rng.normal(size=d), dtype=torch.float32)
        return {f"model.layers.{i}.self_attn.{p}_norm.weight": norm()
                for i in range(cfg["num_hidden_layers"]) for p in ("q", "k")}
    d = base[1]["hidden_size"] // base[1]["num_attention_heads"]
    folder = _variant(tmp_path, base, "qwen3", "Qwen3ForCausalLM", {"head_dim": d, "attention_bias": False}, norms)
    ids = heldout_ids[:N_TOKENS]
    m, ours = _compare(folder, ids)
    assert m.config.qk_norm and not m.config.attn_bias
    _plan_matches(m, ids, ours)


def test_llama3_rope_scaling(tmp_path, base, heldout_ids):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": base[1].get("rope_theta", 100000.0)}
    folder = _variant(tmp_path, base, "llama", "LlamaForCausalLM", {"rope_scaling": rope, "rope_parameters": rope},
                      lambda cfg: {})
    ids = heldout_ids[:N_TOKENS]
    m, ours = _compare(folder, ids)
    f = np.asarray(m.config.rope_freq_factors)
    assert f.min() == pytest.approx(1.0) and f.max() == pytest.approx(8.0)  # short wavelengths kept, long slowed 8x
    # the scaling mattered: the same weights without it give other logits, far beyond the error against transformers
    (tmp_path / "plain").mkdir()
    unscaled = _variant(tmp_path / "plain", base, "llama", "LlamaForCausalLM", {}, lambda cfg: {})
    plain_model = models.load(unscaled)
    assert not plain_model.config.rope_freq_factors
    plain = forward(plain_model, ids)
    assert np.abs(plain - ours).max() > 0.1
    _plan_matches(m, ids, ours)
