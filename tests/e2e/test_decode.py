"""Decoding on the device agent: a KV cache kept there across runs, batches of candidates (test-time scaling),
Best-of-N and beam search, and every way a decode request can be wrong."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from edgeprobe.device import DecodeSession, Device, DeviceError
from edgeprobe.generate import HostSession, replay
from edgeprobe.trace import cosine
from edgeprobe.tts import beam_search, best_of_n, mean_logprob
from edgeprobe_kernels.linear_records import run_q4_0_tile_seq


@pytest.fixture(scope="module")
def qm(smollm):
    from edgeprobe.quant import quantize

    return quantize(smollm, "q4_0-tile")


def test_decode_batch_on_the_agent_matches_the_host_step_by_step(dev, qm, smollm, heldout_ids, independent_linear):
    prompt = heldout_ids[:12]
    seen = []
    d = dev.generate(qm, prompt, 4, batch=3, temperature=0.9, seed=0, progress=False,
                     on_step=lambda i, tok: seen.append((i, tok.tolist())))
    assert d.tokens.shape == (3, 4) and [i for i, _ in seen] == [0, 1, 2, 3]
    assert [t for _, t in seen] == d.tokens.T.tolist()  # streamed as decoded
    assert len({tuple(r) for r in d.tokens.tolist()}) > 1  # sampled candidates differ
    # the host with the npu lane's kernel (q4_0-tile's sums in k order): the same bits, every row of every step
    seq = {n: run_q4_0_tile_seq(rec, qm.store.get, {}) for n, rec in qm.manifest["linears"].items()}
    host = replay(qm.model, prompt, d.tokens, linear=lambda n, x: seq[n](x))
    assert len(d.logits) == 5 and all(np.array_equal(a, b) for a, b in zip(d.logits, host))
    # independent: the HMX tile layout written from its spec here, each 32-value group through gguf-py's Q4_0;
    # FP16 rounding of the dequantized products is all that separates it from the agent's vlut16 path
    ref = replay(smollm, prompt, d.tokens, linear=independent_linear(qm, smollm))
    flt = replay(smollm, prompt, d.tokens)
    rows = [(a[j], b[j], c[j]) for a, b, c in zip(d.logits, ref, flt) for j in range(a.shape[0])]
    cos_ref = min(cosine(a, b) for a, b, _ in rows)
    near = max(np.linalg.norm(a - b) / np.linalg.norm(a - c) for a, b, c in rows)
    cos_flt = min(cosine(a - a.mean(), c - c.mean()) for a, _, c in rows)  # centred: softmax ignores a common offset
    print(f"\nq4_0-tile decode on the agent: min cosine vs the reference {cos_ref:.7f}, |agent - reference| <= "
          f"{near:.1e} x |agent - float|, min centred cosine vs float {cos_flt:.4f}")
    # every step computed tile-group Q4_0, not float (6e-3 seen) ...
    assert cos_ref >= 0.9999 and near < 0.05
    # ... and still ranks the vocabulary like float, though sampled tokens (T = 0.9) put it where 4-bit weights
    # disagree most (0.73 seen on random tokens, 0.86 on text)
    assert cos_flt > 0.6
    groups = {e["group"] for e in d.trace.events}
    assert groups == {"prefill", "step0", "step1", "step2", "step3"}
    assert d.decode_tok_per_s > 0 and len(d.step_ms) == 4 and all(t > 0 for t in d.step_ms)
    # q4_0-tile: the NPU's format, and the NPU TTS paper's whole step on the NPU: every op of a step on the npu lane
    # (emulated), each layer one fused op whose linears' time is one of its parts
    step0 = [e for e in d.trace.events if e["group"] == "step0"]
    layers = [e for e in step0 if e["kind"] == "fused"]
    assert {e["lane"] for e in step0} == {"npu"} and all(e["emulated"] == "semantics" for e in step0)
    assert len(layers) == qm.model.config.n_layers and all(e["parts_us"]["linear"] > 0 for e in layers)
    # greedy: every copy of one prompt decodes the same tokens (the fork copied the prefilled cache)
    g = dev.generate(qm, prompt, 3, batch=2, progress=False)
    assert (g.tokens[0] == g.tokens[1]).all()
    h = replay(qm.model, prompt, g.tokens[:1], linear=qm.linear)
    assert g.tokens[0].tolist() == [int(h[i][0].argmax()) for i in range(3)]


def test_the_decode_loop_on_the_agent_gives_the_host_loops_tokens_and_bits(dev, qm, heldout_ids):
    prompt = heldout_ids[:8]
    host = dev.generate(qm, prompt, 3, batch=2, progress=False)
    seen = []
    agent = dev.generate(qm, prompt, 3, batch=2, progress=False, loop="agent", on_step=lambda i, t: seen.append(i))
    assert agent.tokens.tolist() == host.tokens.tolist() and seen == [0, 1, 2]
    assert len(agent.logits) == 4 and all((a == b).all() for a, b in zip(agent.logits, host.logits))
    assert {e["group"] for e in agent.trace.events} == {"prefill", "step0", "step1", "step2"}
    assert len(agent.step_ms) == 3 and all(t > 0 for t in agent.step_ms) and len(agent.step_counters) == 3
    assert [e["name"] for e in agent.trace.events if e["group"] == "step1"] == \
        [e["name"] for e in host.trace.events if e["group"] == "step1"]
    with dev.session(qm, 16, progress=False) as s:  # the loop moves the session on: a host step continues it
        s.prefill(prompt)
        fed, logits = s.greedy([int(host.tokens[0, 0])], 2, keep="last")
        assert fed.tolist() == [host.tokens[0, :2].tolist()] and len(logits) == 1 and s.length == 10
        assert (logits[0][0] == host.logits[2][0]).all()
        assert (s.step([int(host.tokens[0, 2])])[0] == host.logits[3][0]).all()
        fed, logits = s.greedy([int(host.logits[3][0].argmax())], 1)  # a loop of one step keeps the loop's form
        assert fed.shape == (1, 1) and len(logits) == 1 and logits[0].shape == (1, host.logits[3].shape[1])
        assert s.length == 12 and len(s.step_ms) == 4 and {e["group"] for e in s.events} >= {"step3"}
    last = dev.generate(qm, prompt, 3, batch=2, progress=False, loop="agent", logits="last")  # tokens + last logits
    assert last.tokens.tolist() == host.tokens.tolist() and len(last.logits) == 2
    assert (last.logits[0] == host.logits[0]).all() and (last.logits[1] == host.logits[3]).all()
    assert {e["group"] for e in last.trace.events} == {"prefill", "step0", "step1", "step2"}
    hl = dev.generate(qm, prompt, 2, progress=False, logits="last")  # the host's loop keeps the last only too
    assert len(hl.logits) == 2 and (hl.logits[1] == host.logits[2][:1]).all()
    with pytest.raises(ValueError, match="greedy"):
        dev.generate(qm, prompt, 2, temperature=0.5, loop="agent", progress=False)
    with pytest.raises(ValueError, match="'all'.*'last'"):
        dev.generate(qm, prompt, 2, loop="agent", logits="first", progress=False)


def test_generates_again_leave_nothing_behind_for_the_agents_gc(dev, qm, heldout_ids):
    """Each generate puts its session's plans again; the agent keeps the first copy of a plan, so its runner cache
    holds no new objects, and what a full collection walks stays level (the start's objects frozen out of it)."""
    prompt = heldout_ids[:6]
    dev.generate(qm, prompt, 2, progress=False, loop="agent")
    before = dev.request("stats")[0]
    for _ in range(6):
        dev.generate(qm, prompt, 2, progress=False, loop="agent")
    after = dev.request("stats")[0]
    assert after["plans"] == before["plans"] and after["gc"]["frozen"] > 50_000  # numba's and the modules' objects
    # each plan copy stayed alive through the runner cache before: 6 generates left ~16,700 objects more
    assert after["gc"]["tracked"] - before["gc"]["tracked"] < 5_000, (before["gc"], after["gc"])


def test_bad_decode_requests_get_clear_errors(tmp_path, qm, heldout_ids):
    resident = sum(int(b["nbytes"]) for b in qm.manifest["blobs"].values())
    with Device.local(store=tmp_path / "st", memory_budget_mb=(resident + 2e6) / 1e6) as d:
        with d.session(qm, 8, progress=False) as s:
            with pytest.raises(DeviceError, match="prefill the prompt first") as e:
                s.step([1])
            assert e.value.code == "no_prefill"
            s.prefill(heldout_ids[:6])
            s.step([1])
            s.step([2])
            with pytest.raises(DeviceError, match="capacity") as e:
                s.step([3])
            assert e.value.code == "context_full"
            with pytest.raises(DeviceError, match="reorder indices"):
                s.reorder([0, 5])
            with pytest.raises(ValueError, match="one token for each"):
                s.step([1, 2])
        with pytest.raises(ValueError, match="context length"):
            DecodeSession(d, qm, 10 ** 6, "huge", progress=False)


def test_a_batch_beyond_the_memory_budget_and_a_budget_below_the_weights_are_refused(tmp_path, qm, heldout_ids):
    resident = sum(int(b["nbytes"]) for b in qm.manifest["blobs"].values())
    with Device.local(store=tmp_path / "st", memory_budget_mb=(resident + 2e6) / 1e6) as d:
        d.generate(qm, heldout_ids[:4], 2, batch=1, progress=False)  # fits: a few hundred kB of KV cache
        with pytest.raises(DeviceError, match="lower the batch") as e:
            d.request("open_session", model_id=d.load_model(qm), session="big", batch=64, capacity=512)
        assert e.value.code == "memory_budget"
    with Device.local(store=tmp_path / "st", memory_budget_mb=resident / 2e6) as d:
        with pytest.raises(DeviceError, match="resident weights") as e:
            d.generate(qm, heldout_ids[:4], 2, progress=False)
        assert e.value.code == "memory_budget"


def test_best_of_n_and_beam_search_keep_the_right_kv_rows(smollm, heldout_ids):
    from edgeprobe.forward import forward

    prompt = heldout_ids[:8]
    cands = best_of_n(HostSession(smollm), prompt, n=4, max_tokens=5, temperature=1.0, seed=3)
    assert len(cands) == 4 and all(len(c.tokens) == 5 for c in cands)
    assert [c.score for c in cands] == sorted((c.score for c in cands), reverse=True)
    assert all(c.score == pytest.approx(mean_logprob(c.tokens, c.logprobs)) for c in cands)
    picky = best_of_n(HostSession(smollm), prompt, n=4, max_tokens=5, temperature=1.0, seed=3,
                      scorer=lambda toks, lps: -float(np.mean(lps)))  # a pluggable scorer reverses the order
    assert [c.tokens for c in picky] == [c.tokens for c in reversed(cands)]
    beams = beam_search(HostSession(smollm), prompt, width=2, expand=3, step_tokens=2, n_steps=3, temperature=1.0,
                        seed=1)
    assert len(beams) == 2 and all(len(b.tokens) == 6 for b in beams) and beams[0].score >= beams[1].score
    # the log-probs recorded along the way equal a fresh pass over prompt + beam: the rows kept were right
    for b in beams:
        full = np.concatenate([prompt, b.tokens])
        logits = forward(smollm, full)[len(prompt) - 1:-1].astype(np.float64)
        lp = logits - logits.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        np.testing.assert_allclose([lp[i, t] for i, t in enumerate(b.tokens)], b.logprobs, atol=2e-3)


def test_best_of_n_runs_on_the_agent_session(dev, qm, heldout_ids):
    with dev.session(qm, 16, progress=False) as s:
        cands = best_of_n(s, heldout_ids[:8], n=3, max_tokens=4, temperature=0.8, seed=0)
        assert s.batch == 3 and len(s.step_ms) == 4
    # the host with the npu lane's arithmetic (q4_0-tile's sums in order, not BLAS's): sampled tokens are a step
    # function of the logits, so only the same bits make equal samples a fair test rather than luck
    seq = {n: run_q4_0_tile_seq(rec, qm.store.get, {}) for n, rec in qm.manifest["linears"].items()}
    host = best_of_n(HostSession(qm.model, lambda n, x: seq[n](x)), heldout_ids[:8], n=3, max_tokens=4,
                     temperature=0.8, seed=0)
    assert sorted(c.tokens for c in cands) == sorted(c.tokens for c in host)
    assert sorted(c.logprobs for c in cands) == sorted(c.logprobs for c in host)


def test_run_cli_decodes_a_batch(tmp_path):
    env = {**os.environ, "EDGEPROBE_AGENT_STORE": str(tmp_path / "st")}
    r = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--scheme", "q4_0-tile", "--prompt-len", "12",
                        "--decode", "3", "--batch", "2", "--temperature", "0.7", "--json", "--no-progress",
                        "--trace", str(tmp_path / "t.json")], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["decode_tok_per_s"] > 0 and out["batch"] == 2 and out["decode_steps"] == 3 and len(out["texts"]) == 2
    assert out["decode_logits_min_cosine_vs_host"] >= 0.999 and out["logits_cosine_vs_host"] >= 0.999
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    bad = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--batch", "4", "--prompt-len", "8"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert bad.returncode == 2 and "--decode" in bad.stderr and "Traceback" not in bad.stderr
    r = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--scheme", "q4_0-tile", "--prompt-len", "12",
                        "--decode", "2", "--decode-loop", "agent", "--json", "--no-progress"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["decode_loop"] == "agent" and out["decode_logits_min_cosine_vs_host"] >= 0.999
    bad = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--decode", "2", "--decode-loop", "agent",
                          "--temperature", "0.5"], capture_output=True, text=True, timeout=900, env=env)
    assert bad.returncode == 2 and "greedy" in bad.stderr and "Traceback" not in bad.stderr


def test_neuron_window_keeps_the_last_k_steps_and_moves_rows_into_holes():
    from edgeprobe_agent.neurons import NeuronWindow

    rng = np.random.default_rng(0)
    bundle = rng.standard_normal((40, 3, 8)).astype(np.float16)
    reads = []

    def read(rows):
        reads.append(len(rows))
        return bundle[rows]

    w = NeuronWindow(40, 8, window=2)
    history = []
    for step in range(12):
        active = np.sort(rng.choice(40, size=rng.integers(3, 12), replace=False))
        history.append(set(active.tolist()))
        st = w.update(active, read)
        keep = set().union(*history[-2:])  # neurons used in the last 2 steps, and only those
        assert set(w.neuron_of[:w.n].tolist()) == keep and st["resident"] == len(keep)
        assert all(w.slot_of[j] == s for s, j in enumerate(w.neuron_of[:w.n]))
        np.testing.assert_array_equal(w.mat[:, :w.n].transpose(1, 0, 2), bundle[w.neuron_of[:w.n]].astype(np.float32))
        new = history[-1] - (history[-2] if step else set()) - (history[-3] if step > 1 else set())
        assert st["loaded"] == len(new) or step == 0
    assert sum(reads) < sum(len(h) for h in history)  # the window saved reads


def test_neurons_stream_from_flash_on_the_agent(dev, smollm, heldout_ids):
    from edgeprobe.corpus import read_corpus
    from edgeprobe.neurons import add_bundles, sparse_hooks, sparsity_perplexity
    from edgeprobe.profile.predictor import train_predictors
    from edgeprobe.profile.sparsity import calibrate_thresholds
    from edgeprobe.quant import quantize

    train = smollm.tokenizer.encode(read_corpus("train"))
    taus = calibrate_thresholds(smollm, train, tokens=128)
    pred = train_predictors(smollm, train[:256], heldout_ids[:128], taus, rank=8, steps=3, window=128, progress=False)
    qm = quantize(smollm, "float")
    add_bundles(qm, smollm, pred)
    prompt = heldout_ids[:8]
    sparse = dev.generate(qm, prompt, 3, ffn_flash={"mode": "sparse", "window": 2}, progress=False)
    host = replay(smollm, prompt, sparse.tokens, hooks=sparse_hooks(pred, union=True))
    # the agent's FFN from flash multiplies the gathered neuron bundles, the host BLAS over the whole (masked)
    # matrices: float32 sums in another order, which 30 layers amplify (max |diff| / max |logit|: 4.6e-4 dense,
    # 2.1e-3 sparse seen); a mask applied wrongly moves the logits by far more (the dense pass, checked below)
    def rel(a, b):
        return float(np.abs(a - b).max() / np.abs(b).max())

    assert all(rel(a[0], b[0]) < 5e-3 for a, b in zip(sparse.logits, host))
    unmasked = replay(smollm, prompt, sparse.tokens)
    assert max(rel(a[0], b[0]) for a, b in zip(sparse.logits, unmasked)) > 4 * max(
        rel(a[0], b[0]) for a, b in zip(sparse.logits, host))
    dense = dev.generate(qm, prompt, 3, ffn_flash={"mode": "dense"}, progress=False)
    full = replay(smollm, prompt, dense.tokens)
    assert all(rel(a[0], b[0]) < 2e-3 for a, b in zip(dense.logits, full))
    bundle_bytes = sum(qm.manifest["blobs"][n["bundle"]]["nbytes"] for n in qm.manifest["neurons"].values())
    assert all(c["flash_read_bytes"] == bundle_bytes for c in dense.step_counters)  # every neuron, every token
    sparse_bytes = [c["flash_read_bytes"] for c in sparse.step_counters]
    assert max(sparse_bytes) < bundle_bytes and all(c["neurons_active"] <= 30 * 1536 for c in sparse.step_counters)
    reads = [e for e in sparse.trace.events if e["kind"] == "flash_read"]
    assert reads and all(e["lane"] == "io" for e in reads)
    ppl = sparsity_perplexity(smollm, pred, heldout_ids[:256], window=64, max_windows=2)
    # recomputed here: each window's FFNs masked by the predictor's sigmoid(x A B + b) > cutoff, row by row, its NLL
    # by a float64 log-softmax written here; the active fraction from the same masks
    from edgeprobe.forward import forward

    nll, active = {"dense": [], "sparse": []}, []

    def masked(i):
        A, B, b = pred.weights[i]
        keep = {}

        def at_in(name, x):
            z = (x @ A) @ B + b
            keep["m"] = 1 / (1 + np.exp(-z)) > float(pred.cutoffs[i])
            active.append(keep["m"].sum(-1).mean() / smollm.config.ffn)
            return x
        return {f"blk.{i}.ffn_in": at_in, f"blk.{i}.ffn_act": lambda name, a: a * keep["m"]}

    hooks = {k: v for i in pred.weights for k, v in masked(i).items()}
    for w in range(2):
        ids = np.asarray(heldout_ids[w * 64:(w + 1) * 64])
        for how, h in (("dense", None), ("sparse", hooks)):
            z = forward(smollm, ids, hooks=h).astype(np.float64)[:-1]
            lse = z.max(-1) + np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1))
            nll[how].extend(lse - z[np.arange(63), ids[1:]])
    assert ppl["dense_ppl"] == pytest.approx(np.exp(np.mean(nll["dense"])), rel=1e-6)
    assert ppl["sparse_ppl"] == pytest.approx(np.exp(np.mean(nll["sparse"])), rel=1e-6)
    assert ppl["predicted_active_fraction"] == pytest.approx(np.mean(active), rel=1e-6)
    assert ppl["sparse_ppl"] != pytest.approx(ppl["dense_ppl"], rel=1e-4) and 0 < np.mean(active) < 1
    with dev.session(qm, 12, progress=False, ffn_flash={"mode": "sparse"}) as s:
        s.prefill(prompt)
        with pytest.raises(DeviceError, match="one sequence"):
            s.reorder([0, 0])
    with pytest.raises(ValueError, match="decode session"):
        from edgeprobe.plan import prefill_plan

        prefill_plan(qm.manifest, 4, ffn_flash={"mode": "sparse"})


@pytest.fixture(scope="module")
def moe():
    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.profile import run
    from edgeprobe.profile.experts import CoActivationStats, PreloadPredictor

    m = models.load("tiny-moe")
    stats = run(m, m.tokenizer.encode(read_corpus("train")), CoActivationStats.for_model(m), window=128,
                max_tokens=2048, progress=False)
    return m, PreloadPredictor.from_stats(stats)


def test_experts_stream_from_flash_through_the_buffer(dev, moe, tmp_path):
    from edgeprobe.plan import attach_expert_streaming, prefill_plan
    from edgeprobe.quant import quantize

    m, pred = moe
    qm = quantize(m, "float")
    prompt = m.tokenizer.encode("The quick brown fox jumps over")
    with pytest.raises(ValueError, match="co-activation tables"):
        prefill_plan(qm.manifest, 4, session=True, experts_flash={"capacity": 4, "preload_n": 2})
    attach_expert_streaming(qm, pred)
    runs = {name: dev.generate(qm, prompt, 4, experts_flash=fl, progress=False)
            for name, fl in (("resident", None), ("none", {"capacity": 0}),
                             ("preload", {"capacity": 0, "preload_n": 2}),
                             ("all", {"capacity": 48, "policy": "edgemoe", "preload_n": 2}))}
    for name, d in runs.items():  # the same logits as the host, whatever the buffer does
        host = replay(m, prompt, d.tokens)
        assert all(cosine(a[0], b[0]) >= 0.999 for a, b in zip(d.logits, host)), name
    c = lambda name, k: sum(x.get(f"experts_{k}", 0) for x in runs[name].step_counters)
    assert c("none", "uses") == 4 * 6 * 2 and c("none", "hits") == 0 and c("none", "demand_reads") == c("none", "uses")
    assert c("preload", "preload_reads") > 0 and c("preload", "hits") == c("preload", "preload_used") > 0
    assert c("all", "hits") > c("none", "hits")  # the buffer keeps experts across tokens
    per_expert = 3 * 256 * m.config.expert_ffn * 4
    none_bytes = [x["flash_read_bytes"] for x in runs["none"].step_counters]
    assert all(b == 12 * per_expert for b in none_bytes)  # every routed expert read from flash, every token
    io = [e for e in runs["preload"].trace.events if e["kind"] == "flash_read"]
    assert io and {e["lane"] for e in io} == {"io"}
    resident = sum(b["nbytes"] for s, b in qm.manifest["blobs"].items() if s not in set(qm.manifest["streamed_blobs"]))
    total = sum(b["nbytes"] for b in qm.manifest["blobs"].values())
    assert resident < total / 2
    with Device.local(store=tmp_path / "st", memory_budget_mb=(resident + 1e6) / 1e6) as d:  # experts need not fit
        d.generate(qm, prompt, 2, experts_flash={"capacity": 4, "policy": "lru"}, progress=False)
        plain = quantize(m, "float")  # its experts are not marked streamed: they count as resident
        with pytest.raises(DeviceError, match="resident weights") as e:
            d.generate(plain, prompt, 2, progress=False)
        assert e.value.code == "memory_budget"
