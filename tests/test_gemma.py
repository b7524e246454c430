"""Gemma 3 270M (the real GGUF, Q4_K_M) through the one forward pass and the one template, checked against
transformers' own Gemma 3 on the same dequantized weights and against its GGUF tokenizer."""
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from edgeprobe.corpus import read_corpus
from edgeprobe.evaluate import perplexity, window_nll
from edgeprobe.forward import KVCache, forward


@pytest.fixture(scope="module")
def held(gemma):
    return gemma.tokenizer.encode(read_corpus("heldout"))


@pytest.fixture(scope="module")
def hf_gguf(gemma, one_gguf_parse):
    """The checkpoint's folder and file name, for transformers (which parses it once: tests/conftest.py)."""
    p = Path(gemma.source)
    return str(p.parent), p.name


def test_config_is_read_from_the_gguf(gemma):
    c = gemma.config
    assert (c.arch, c.n_layers, c.hidden, c.head_dim, c.n_heads, c.n_kv_heads, c.vocab_size) == \
        ("gemma3", 18, 640, 256, 4, 1, 262144)
    assert c.act_fn == "gelu_tanh" and c.qk_norm and c.post_norms and c.tie_embeddings
    assert c.embed_scale == pytest.approx(640 ** 0.5)
    # 5 sliding-window layers of 512 keys, then a global one; local RoPE base 10k, global 1M
    assert [c.window(i) for i in range(6)] == [512] * 5 + [0] and c.theta(0) == 1e4 and c.theta(5) == 1e6
    assert gemma.tokenizer.add_bos and gemma.tokenizer.bos_id == 2


def test_tokenizer_equals_transformers_gguf_tokenizer(gemma, hf_gguf):
    from transformers import AutoTokenizer

    folder, name = hf_gguf
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = read_corpus("heldout")
    samples = [l for l in text.split("\n") if l][:200]
    samples += ["  two  spaces\tand a tab", "ünïcödé 你好 🙂 \u00a0nbsp", "x" * 40]
    for s in samples:
        assert gemma.tokenizer.encode(s, add_bos=False).tolist() == ref.encode(s, add_special_tokens=False), s
    ours = gemma.tokenizer.encode(text)
    assert ours.tolist() == ref.encode(text) and ours[0] == 2  # BOS added, as the metadata asks
    assert gemma.tokenizer.decode(ours[1:200]) == ref.decode(ref.encode(text)[1:200])


def test_logits_agree_with_transformers_across_the_sliding_window(gemma, held, hf_gguf):
    """Past the sliding window, so local and global layers differ; same dequantized weights. The window is 128 keys
    on both sides (the checkpoint's 512, which test_config_is_read_from_the_gguf checks, would take 600+ tokens through
    both models): 200 tokens, the last 72 of them seeing fewer keys in the local layers than in the global ones."""
    import torch
    from transformers import AutoModelForCausalLM

    W, n = 128, 200
    local = dataclasses.replace(gemma, config=dataclasses.replace(gemma.config, sliding_window=W))
    ids = held[:n]
    ours = forward(local, ids)
    folder, name = hf_gguf
    ref_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     sliding_window=W).eval()
    assert ref_model.config.sliding_window == W
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    err = float(np.abs(ours - ref).max())
    print(f"gemma3-270m vs transformers, {n} tokens, window {W}: top-1 {top1:.4f}, max |Δlogit| {err:.2e}")
    assert top1 >= 0.99 and err < 5e-3
    # the window mattered: the full-context model gives other logits past it, and the same ones before it
    full = forward(gemma, ids)
    assert np.abs(full[:W] - ours[:W]).max() < 1e-4 and np.abs(full[W + 8:] - ours[W + 8:]).max() > 0.1
    # and a decode with the KV cache continues the same computation
    cache = KVCache(local.config)
    forward(local, ids[:n - 2], cache=cache, logits="none")
    step = forward(local, ids[n - 2:], cache=cache, logits="all")
    assert np.abs(step - ours[n - 2:]).max() < 1e-3


def test_perplexity_windows_start_with_bos(gemma, held):
    r = perplexity(gemma, held, window=64, max_windows=2, progress=False)
    assert r.windows == 2 and r.tokens_scored == 2 * 63
    text = held[1:]  # encode added BOS: windows take 63 text tokens after their own BOS
    nll = sum(window_nll(forward(gemma, np.concatenate([[2], text[w * 63:(w + 1) * 63]])),
                         np.concatenate([[2], text[w * 63:(w + 1) * 63]])).sum() for w in range(2)) / 126
    assert r.nll == pytest.approx(float(nll), rel=1e-6)
    assert 1.5 < r.perplexity < 200  # a trained model on English prose


def test_plans_run_gemma_like_forward(gemma, held):
    """The template's Gemma ops (q/k norms, post norms, GeGLU, scaled embeddings, windows), run in-process."""
    from edgeprobe.graph.local import run_plan
    from edgeprobe.plan import prefill_plan
    from edgeprobe.quant import quantize

    qm = quantize(gemma, "float")
    ids = held[:24].astype(np.int32)
    outs, events, _ = run_plan(prefill_plan(qm.manifest, len(ids)), qm.store.get, {"tokens": ids})
    ref = forward(gemma, ids, logits="last")
    assert np.abs(outs["lm_head"][0] - ref).max() < 1e-3
    kinds = {e["kind"] for e in events}
    assert {"geglu", "rms_norm", "attention", "rope"} <= kinds and "swiglu" not in kinds
