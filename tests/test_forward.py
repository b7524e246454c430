"""The one forward pass on the real model: KV cache, batching, hooks, linear override, bad tokens."""
import numpy as np
import pytest

from edgeprobe.errors import TokenRangeError
from edgeprobe.forward import KVCache, float_linear, forward, hook_names


@pytest.fixture(scope="module")
def ids(heldout_ids):
    return heldout_ids[:48]


@pytest.fixture(scope="module")
def full_logits(smollm, ids):
    return forward(smollm, ids)


def test_prefill_then_decode_matches_full_prefill(smollm, ids, full_logits):
    cache = KVCache(smollm.config)
    a = forward(smollm, ids[:30], cache)
    steps = [forward(smollm, ids[t:t + 1], cache, logits="last") for t in range(30, 48)]
    np.testing.assert_allclose(a, full_logits[:30], atol=2e-3)
    np.testing.assert_allclose(np.stack(steps), full_logits[30:], atol=2e-3)
    assert cache.length == 48 and cache.nbytes() == 2 * 30 * 3 * 48 * 64 * 4


def test_cache_growth_keeps_earlier_positions(smollm, ids, full_logits):
    cache = KVCache(smollm.config)
    for t in range(0, 48, 8):  # grows past its first capacity (64 positions) only when needed
        forward(smollm, ids[t:t + 8], cache, logits="none")
    cache.reserve(500)
    assert cache.k[0].shape[2] >= 500
    nxt = forward(smollm, ids[47:48], KVCache(smollm.config), logits="last")  # different context
    cont = forward(smollm, [int(ids[47])], cache, logits="last")  # position 48 after 48 cached tokens
    assert not np.allclose(nxt, cont)


def test_batch_equals_single_sequences(smollm, ids, full_logits):
    other = ids[::-1].copy()
    both = forward(smollm, np.stack([ids, other]))
    np.testing.assert_allclose(both[0], full_logits, atol=2e-3)
    np.testing.assert_allclose(both[1], forward(smollm, other), atol=2e-3)


def test_last_and_none_modes(smollm, ids, full_logits):
    np.testing.assert_allclose(forward(smollm, ids, logits="last"), full_logits[-1], atol=1e-3)
    h = forward(smollm, ids, logits="none")
    assert h.shape == (48, 576)
    np.testing.assert_allclose(h @ smollm.output_weight.T, full_logits, atol=2e-3)


def test_hooks_see_every_point_in_order_with_shapes(smollm, ids):
    seen = []
    forward(smollm, ids[:8], hooks=lambda name, x: seen.append((name, x.shape)))
    assert [n for n, _ in seen] == hook_names(smollm.config)
    shapes = dict(seen)
    assert shapes["blk.0.attn_in"] == (8, 576) and shapes["blk.29.attn_out"] == (8, 576)
    assert shapes["blk.5.ffn_in"] == (8, 576) and shapes["blk.5.ffn_act"] == (8, 1536)
    assert shapes["out_norm"] == (8, 576)
    assert "blk.0.router" not in shapes  # dense model: no router point


def test_hook_can_replace_an_activation(smollm, ids, full_logits):
    zeroed = forward(smollm, ids, hooks={"blk.0.ffn_act": lambda n, x: np.zeros_like(x)})
    assert np.abs(zeroed - full_logits).max() > 1.0
    same = forward(smollm, ids, hooks={"blk.0.ffn_act": lambda n, x: x.copy()})
    assert np.array_equal(same, full_logits)  # the same ops on the same values
    with pytest.raises(ValueError, match="must keep the shape"):
        forward(smollm, ids, hooks={"blk.0.attn_in": lambda n, x: x[:2]})


def test_hooks_by_template_op_name(smollm, ids):
    """A dict of hooks may name any op of the template: the residual stream after layer 0's attention is
    its input plus the output projection (no post norms in SmolLM2)."""
    seen = {}
    grab = lambda n, x: seen.__setitem__(n, np.array(x))
    forward(smollm, ids[:8], hooks={n: grab for n in ("embed", "blk.0.attn_output", "blk.0.attn_residual")})
    assert np.array_equal(seen["blk.0.attn_residual"], seen["embed"] + seen["blk.0.attn_output"])


def test_errors_of_the_callers_code_are_raised_as_they_were(smollm, ids):
    def lin(name, x):
        raise KeyError(f"no such linear {name}")
    with pytest.raises(KeyError, match="blk.0.attn_q"):
        forward(smollm, ids[:4], linear=lin)


def test_linear_override(smollm, ids, full_logits):
    calls = []
    base = float_linear(smollm)

    def lin(name, x):
        calls.append(name)
        return base(name, x)

    np.testing.assert_allclose(forward(smollm, ids, linear=lin), full_logits, atol=1e-5)
    assert len(calls) == 30 * 7 and calls[:3] == ["blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v"]


def test_bad_tokens(smollm):
    with pytest.raises(TokenRangeError, match="outside the vocabulary"):
        forward(smollm, [1, 2, 49152])
    with pytest.raises(TokenRangeError, match="outside the vocabulary"):
        forward(smollm, [-1])
    with pytest.raises(TokenRangeError, match="at least one token"):
        forward(smollm, [])
    with pytest.raises(TokenRangeError, match="integers"):
        forward(smollm, [1.5, 2.0])
    cache = KVCache(smollm.config, batch=2)
    with pytest.raises(ValueError, match="batch"):
        forward(smollm, [1, 2], cache)
