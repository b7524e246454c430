"""Our forward pass against an implementation nobody here wrote: Hugging Face transformers' Llama.

transformers reads the same GGUF file itself (its own dequantization through `gguf`, its own
un-permutation of Q/K to the rotate-half layout), so agreement checks our loader, our RoPE layout
and our arithmetic at once. Also: a Hugging Face folder saved by transformers loads in edgeprobe and
gives the same logits as the GGUF.
"""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from edgeprobe import models
from edgeprobe.evaluate import window_nll
from edgeprobe.forward import forward

N_TOKENS = 256  # the issue asks for at least 128


@pytest.fixture(scope="module", autouse=True)
def _parse_once(one_gguf_parse):
    """transformers reads the GGUF four times in this module: one parse serves them all (tests/conftest.py)."""


@pytest.fixture(scope="module")
def hf_model():
    path = models.resolve("smollm2-135m")
    torch.set_num_threads(2)
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def compared(smollm, hf_model, heldout_ids):
    ids = heldout_ids[1000:1000 + N_TOKENS]
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids, dtype=torch.long)[None]).logits[0].float().numpy()
    return ids, ref, forward(smollm, ids)


# float32 on both sides, the same weights (each side dequantizes the GGUF itself): differences are summation
# order only. Measured 8.8e-5 on these 256 tokens (logits up to ~25), top-1 agreeing on all of them.
LOGIT_TOL = 5e-4


def test_top1_agreement_and_perplexity_against_transformers(compared):
    ids, ref, ours = compared
    err = float(np.abs(ref - ours).max())
    disagree = ref.argmax(-1) != ours.argmax(-1)
    ppl_ref = float(np.exp(window_nll(ref, ids).mean()))
    ppl_ours = float(np.exp(window_nll(ours, ids).mean()))
    print(f"\nreference agreement on {len(ids)} tokens: top-1 {1 - disagree.mean():.4f}, perplexity ours "
          f"{ppl_ours:.6f} vs transformers {ppl_ref:.6f}, max |dlogit| {err:.2e}")
    assert err < LOGIT_TOL
    top2 = np.sort(ref, axis=-1)[:, -2:]
    assert (top2[disagree, 1] - top2[disagree, 0] <= 2 * err).all()  # only a near-tie within the error may flip
    assert abs(np.log(ppl_ours / ppl_ref)) <= 2 * err  # a token's NLL moves at most 2 max|dlogit|


def test_logits_agree_elementwise(compared):
    _, ref, ours = compared
    assert np.abs(ref - ours).max() < LOGIT_TOL


def test_tokenizer_agrees_with_transformers_gguf_tokenizer(smollm):
    path = models.resolve("smollm2-135m")
    tk = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers' GGUF tokenizer converter ignores `tokenizer.ggml.pre` (no per-digit split), so
    # compare on text without digits; the digit rule is tested against the metadata in test_models.
    text = ("Identifiers are names. When a name is bound to an object, evaluation of the atom yields "
            "that object; otherwise a NameError is raised.\n\n   Private name mangling: __spam -> _Ham__spam!")
    assert smollm.tokenizer.encode(text).tolist() == tk(text, add_special_tokens=False)["input_ids"]


def _save_hf_folder(hf_model, folder, dtype):
    """Write transformers' weights (rotate-half layout) as a plain Hugging Face folder.

    save_pretrained refuses GGUF-loaded models, so write safetensors, config and tokenizer directly.
    """
    state = {k: v.to(dtype).contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    cfg = hf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    path = models.resolve("smollm2-135m")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(folder)


def test_hf_folder_loads_and_matches_gguf(tmp_path, smollm, hf_model, compared):
    _save_hf_folder(hf_model, tmp_path, torch.float32)
    m = models.load(tmp_path)
    assert m.meta["format"] == "hf" and m.config.n_layers == 30 and m.config.n_kv_heads == 3
    ids, _, ours = compared
    np.testing.assert_allclose(forward(m, ids[:64]), ours[:64], atol=2e-3)


def test_bf16_safetensors(tmp_path, smollm, hf_model, compared):
    _save_hf_folder(hf_model, tmp_path, torch.bfloat16)
    m = models.load(tmp_path)
    w = m.weights["blk.0.ffn_up.weight"]
    ref = smollm.weights["blk.0.ffn_up.weight"]
    assert w.dtype == np.float32 and np.abs(w - ref).max() <= np.abs(ref).max() * 2 ** -7
