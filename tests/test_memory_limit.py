"""A pass whose one layer and activations exceed the memory limit is refused before it starts, with the numbers
(models.config.check_fits); every expected number is computed here from config.json, not by the code under test."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeprobe import models
from edgeprobe.evaluate import perplexity
from edgeprobe.models.config import MEMORY_LIMIT_ENV, MemoryLimitError, check_fits, memory_limit, parse_bytes
from edgeprobe.profile import run

CONFIGS = Path(__file__).parent / "data" / "configs"
MiB = 1 << 20


def _json(name):
    return json.loads((CONFIGS / name / "config.json").read_text())


def _layer_bytes(j, experts=0, expert_ffn=0, bias=False):
    """float32 bytes of one decoder layer from config.json's numbers (norms: attention and FFN RMSNorm weights)."""
    h, H, KV = j["hidden_size"], j["num_attention_heads"], j["num_key_value_heads"]
    d = j.get("head_dim") or h // H
    attn = h * H * d * 2 + h * KV * d * 2 + (H * d + 2 * KV * d if bias else 0)
    ffn = experts * (3 * h * expert_ffn) + h * experts if experts else 3 * h * j["intermediate_size"]
    return 4 * (attn + ffn + 2 * h)


def _llama8b_numbers(T, logits=False):
    j = _json("llama-3.1-8b")
    h, H, KV, f, V = j["hidden_size"], j["num_attention_heads"], j["num_key_value_heads"], j["intermediate_size"], \
        j["vocab_size"]
    d = h // H
    per_token = 3 * h + 2 * H * d + 2 * KV * d + 2 * H * T + 3 * f + (2 * V if logits else 0)
    return _layer_bytes(j), 4 * T * per_token


@pytest.fixture(scope="module")
def llama8b():
    return models.load(CONFIGS / "llama-3.1-8b")  # config.json alone: any weight access would raise


def _message(name, what, lb, ab, T, limit, source):
    m = lambda n: f"{n / MiB:.1f} MiB"  # noqa: E731
    return (f"{name}: the {what} needs one layer's float32 weights ({m(lb)}) plus activations over a window of {T} "
            f"tokens ({m(ab)}) = {m(lb + ab)}, more than the limit of {m(limit)} ({source}); free memory, use a "
            f"smaller --window, or set {MEMORY_LIMIT_ENV} (e.g. 8G) if more is free")


def test_llama_8b_profile_refused_with_its_numbers(llama8b, monkeypatch):
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "500M")
    lb, ab = _llama8b_numbers(512)
    assert lb == 4 * 218_112_000  # 4096 x 128 x 80 (attention) + 3 x 4096 x 14336 (FFN) + 2 x 4096 (norms)
    with pytest.raises(MemoryLimitError) as e:
        run(llama8b, np.zeros(1024, np.int64), window=512, progress=False)
    err = e.value
    assert (err.layer_bytes, err.activation_bytes, err.limit, err.limit_source) == (lb, ab, 500 * MiB, MEMORY_LIMIT_ENV)
    assert str(err) == _message("llama-3.1-8b", "profile pass", lb, ab, 512, 500 * MiB, MEMORY_LIMIT_ENV)
    assert "\n" not in str(err)


def test_llama_8b_perplexity_counts_the_logits(llama8b, monkeypatch):
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1G")
    lb, ab = _llama8b_numbers(256, logits=True)
    with pytest.raises(MemoryLimitError) as e:
        perplexity(llama8b, np.zeros(1024, np.int64), window=256, progress=False)
    assert (e.value.layer_bytes, e.value.activation_bytes, e.value.limit) == (lb, ab, 1 << 30)
    assert str(e.value) == _message("llama-3.1-8b", "perplexity pass", lb, ab, 256, 1 << 30, MEMORY_LIMIT_ENV)


def test_limit_is_inclusive_at_the_exact_need(llama8b, monkeypatch):
    lb, ab = _llama8b_numbers(512)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(lb + ab))
    assert check_fits(llama8b.config, 512) == {"layer_bytes": lb, "activation_bytes": ab, "limit": lb + ab,
                                                "limit_source": MEMORY_LIMIT_ENV}
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(lb + ab - 1))
    with pytest.raises(MemoryLimitError):
        check_fits(llama8b.config, 512)


def test_other_layouts_layer_bytes(monkeypatch):
    """Mixtral: 8 experts and their router; Qwen2.5: Q/K/V biases."""
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1T")
    j = _json("mixtral-8x7b")
    got = check_fits(models.load(CONFIGS / "mixtral-8x7b").config, 64)
    assert got["layer_bytes"] == _layer_bytes(j, experts=8, expert_ffn=j["intermediate_size"])
    k, fe, h, H, KV = 2, j["intermediate_size"], j["hidden_size"], j["num_attention_heads"], j["num_key_value_heads"]
    assert got["activation_bytes"] == 4 * 64 * (3 * h + 2 * (H + KV) * (h // H) + 2 * H * 64 + 3 * (k * fe + 8))
    j = _json("qwen2.5-3b")
    assert check_fits(models.load(CONFIGS / "qwen2.5-3b").config, 64)["layer_bytes"] == _layer_bytes(j, bias=True)


def test_smollm2_fits_and_runs_at_its_exact_need(smollm, monkeypatch):
    """The positive case: under MemAvailable, and under a limit of exactly what the check computes, the pass runs;
    one byte less is refused."""
    monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
    fits = check_fits(smollm.config, 64)
    assert fits["limit_source"] == "MemAvailable in /proc/meminfo" and fits["limit"] > 0
    c = smollm.config
    assert fits["layer_bytes"] == 4 * (c.hidden * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
                                       + 3 * c.hidden * c.ffn + 2 * c.hidden)
    need = fits["layer_bytes"] + fits["activation_bytes"]
    ids = smollm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(need))
    run(smollm, ids, window=64, max_tokens=64, progress=False)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(need - 1))
    with pytest.raises(MemoryLimitError):
        run(smollm, ids, window=64, max_tokens=64, progress=False)


def test_limit_sources(monkeypatch):
    assert parse_bytes("8G") == 8 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("1.5 GB") == 3 << 29
    assert parse_bytes("1000") == 1000
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "lots")
    with pytest.raises(MemoryLimitError, match="is not a size"):
        memory_limit()
    monkeypatch.delenv(MEMORY_LIMIT_ENV)
    limit, source = memory_limit()
    assert source == "MemAvailable in /proc/meminfo" and limit > 0 and limit % 1024 == 0


def test_cli_refuses_in_one_line_with_exit_2(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    env = {**os.environ, MEMORY_LIMIT_ENV: "1M"}
    p = subprocess.run([sys.executable, "-m", "edgeprobe", "eval", "--model", "smollm2-135m", "--text", str(text),
                        "--window", "64", "--no-progress"], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeprobe: error: smollm2-135m: the perplexity pass needs one "
                                                   "layer's float32 weights (13.5 MiB)")
    assert "more than the limit of 1.0 MiB (EDGEPROBE_MEMORY_LIMIT)" in lines[0]
