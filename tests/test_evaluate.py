"""Perplexity windows, generation, the CLI and their bad input."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from edgeprobe.errors import TextError, WindowError
from edgeprobe.evaluate import log_softmax, perplexity
from edgeprobe.forward import forward
from edgeprobe.generate import generate


def test_perplexity_windows_match_manual_computation(smollm, heldout_ids):
    ids = heldout_ids[:100]  # 3 windows of 32, a 4-token tail dropped
    res = perplexity(smollm, ids, window=32, progress=False)
    assert (res.windows, res.tokens_scored, res.tokens_total) == (3, 93, 100)
    nll = []
    for w in range(3):
        chunk = ids[w * 32:(w + 1) * 32]
        lp = torch.log_softmax(torch.from_numpy(forward(smollm, chunk).astype(np.float64)), -1).numpy()  # not ours
        nll += [-lp[t - 1, chunk[t]] for t in range(1, 32)]
    assert res.perplexity == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-5)
    assert 1.0 < res.perplexity < 200 and res.tok_per_s > 0


def test_perplexity_bad_input(smollm):
    with pytest.raises(WindowError, match=">= 2"):
        perplexity(smollm, [1, 2, 3], window=1)
    with pytest.raises(WindowError, match="context length"):
        perplexity(smollm, [1, 2, 3], window=10**6)
    with pytest.raises(TextError, match="empty"):
        perplexity(smollm, smollm.tokenizer.encode(""), window=8)
    with pytest.raises(TextError, match="fewer than one window"):
        perplexity(smollm, smollm.tokenizer.encode("short text"), window=64)


def test_greedy_generation_is_deterministic_and_uses_the_cache(smollm):
    g1 = generate(smollm, "The capital of France is", n=6)
    g2 = generate(smollm, "The capital of France is", n=6)
    assert g1.tokens == g2.tokens and "Paris" in g1.text
    # the cached continuation equals recomputing greedily from scratch
    ids = list(smollm.tokenizer.encode("The capital of France is"))
    for t in g1.tokens[:3]:
        assert int(np.argmax(forward(smollm, ids, logits="last"))) == t
        ids.append(t)


def test_log_softmax_matches_torch():
    z = np.random.default_rng(0).normal(scale=30.0, size=(5, 1000)).astype(np.float32)
    ref = torch.log_softmax(torch.from_numpy(z.astype(np.float64)), -1).numpy()
    assert np.abs(log_softmax(z) - ref).max() < 1e-12


def test_sampled_generation_draws_as_the_agent_workflow_does(smollm):
    """Host generate and the agent workflow's loop (workflows.generate: sampling.sample on each step's logits, one
    rng from the seed) call the one sampler and give the same tokens for the same seed and logits."""
    from edgeprobe import generate as generate_module
    from edgeprobe import tts, workflows
    from edgeprobe.generate import HostSession
    from edgeprobe_kernels.sampling import sample

    assert workflows.sample is sample and generate_module.sample is sample and tts.sample is sample
    prompt, n, temperature, seed = "The capital of France is", 8, 1.0, 3
    g = generate(smollm, prompt, n=n, temperature=temperature, seed=seed, stop_at_eos=False)
    s, rng = HostSession(smollm), np.random.default_rng(seed)
    logits = s.prefill(smollm.tokenizer.encode(prompt))
    fed = []
    for _ in range(n):
        fed.append(int(sample(logits, temperature, rng)[0]))
        logits = s.step([fed[-1]])
    assert g.tokens == fed
    greedy = generate(smollm, prompt, n=n, seed=seed, stop_at_eos=False).tokens
    assert fed != greedy  # the draws sampled: not the argmax path


def _cli(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "edgeprobe", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_cli_eval_json(tmp_path, smollm):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    r = _cli("eval", "--model", "smollm2-135m", "--text", str(text), "--window", "64", "--json", "--no-progress")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"perplexity", "tokens_scored", "tok_per_s"} <= set(out)
    n = len(smollm.tokenizer.encode(text.read_text()))
    assert out["tokens_scored"] == (n // 64) * 63
    assert out["perplexity"] < 5  # a repeated sentence becomes predictable


def test_cli_generate():
    r = _cli("generate", "--model", "smollm2-135m", "--prompt", "The capital of France is", "-n", "4")
    assert r.stdout.startswith("The capital of France is") and "Paris" in r.stdout


@pytest.mark.parametrize("args,msg", [
    (["eval", "--text", "/nonexistent/file.txt"], "does not exist"),
    (["eval", "--model", "/nonexistent/model.gguf"], "no model"),
    (["eval", "--window", "1"], "window must be"),
])
def test_cli_bad_input_exits_2_with_message(args, msg):
    r = _cli(*args, check=False)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


def test_cli_text_shorter_than_window(tmp_path):
    t = tmp_path / "short.txt"
    t.write_text("only a few words")
    r = _cli("eval", "--text", str(t), check=False)
    assert r.returncode == 2 and "fewer than one window" in r.stderr
    e = tmp_path / "empty.txt"
    e.write_text("")
    r = _cli("eval", "--text", str(e), check=False)
    assert r.returncode == 2 and "empty" in r.stderr
