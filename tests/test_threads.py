"""The one thread policy (edgeprobe_kernels.threads): its decision from the measured busy cores, the BLAS and numba
counts it sets and gives back, that host passes and the agent's lanes both take their counts from it, and that a host
pass's bits do not depend on the count it chose (matmul_wt's fixed column blocks)."""
import time
from types import SimpleNamespace

import numba
import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from edgeprobe_kernels import threads as T


def _blas() -> int:
    """numpy's OpenBLAS thread count, read back through threadpoolctl."""
    (info,) = [i for i in threadpool_info() if i["internal_api"] == "openblas"]
    return info["num_threads"]


def _counts() -> tuple[int, int, int]:
    """(BLAS threads, matmul_wt's width, this thread's numba threads)."""
    return _blas(), T.POLICY.width, numba.get_num_threads()


@pytest.mark.parametrize("cores, others, want", [
    (2, 0.0, 2), (2, 0.39, 2), (2, 0.41, 1), (2, 0.67, 1), (2, 1.0, 1), (2, 1.33, 1), (2, 2.0, 1),
    (4, 0.0, 4), (4, 0.5, 3), (4, 1.0, 3), (4, 1.5, 2), (4, 2.41, 1), (4, 4.0, 1),
    (1, 0.0, 1), (2, -0.2, 2),
])
def test_the_decision_leaves_each_core_other_processes_use_over_40_percent_to_them(cores, others, want):
    assert T.threads_for(cores, others) == want
    assert T.ThreadPolicy(cores, load=lambda: others, env=False).threads() == want


def test_a_fixed_count_wins_over_the_measurement(monkeypatch):
    assert T.ThreadPolicy(2, load=lambda: 2.0, fixed=2).threads() == 2
    monkeypatch.setenv("EDGEPROBE_THREADS", "1")
    assert T.ThreadPolicy(2, load=lambda: 0.0).threads() == 1
    assert T.ThreadPolicy(2, load=lambda: 0.0, env=False).threads() == 2  # the agent's unmeasured placeholder
    assert T.ThreadPolicy(2, load=None, env=False).threads() == 2  # no measurement: a quiet machine


def test_cpu_load_is_the_busy_time_of_our_cpus_minus_our_own(tmp_path):
    # jiffies: user nice system idle iowait irq softirq steal; cpu2 is not ours and is left out
    stat = tmp_path / "stat"
    stat.write_text("cpu  0 0 0 0 0 0 0 0\ncpu0 100 0 20 500 5 1 2 3\ncpu1 10 0 0 900 0 0 0 0\n"
                    "cpu2 999 0 0 0 0 0 0 0\nintr 1\n")
    load = T.CpuLoad(cpus=[0, 1], stat_path=str(stat))
    t, busy, own = load.sample()
    assert busy == pytest.approx((100 + 20 + 1 + 2 + 3 + 10) * load.tick_s)
    # one second: 1.5 CPU-seconds busy, 0.2 of them this process's own -> 1.3 cores used by others
    assert load.between((0.0, 10.0, 1.0), (1.0, 11.5, 1.2)) == pytest.approx(1.3)
    assert load.between((0.0, 10.0, 1.0), (1.0, 14.0, 1.0)) == 2.0  # clipped to our CPUs
    assert load.between((0.0, 10.0, 1.0), (1.0, 10.1, 1.5)) == 0.0  # ticks lag process_time: never negative
    assert T.CpuLoad(cpus=[0], stat_path=str(tmp_path / "none")).sample() is None


def test_a_host_pass_sets_blas_and_numba_then_gives_them_back():
    assert T._openblas() is not None and numba.config.NUMBA_NUM_THREADS >= 2  # this suite runs on 2+ cores
    busy = {"others": 1.0}
    p = T.ThreadPolicy(2, load=lambda: busy["others"], env=False)
    with threadpool_limits(limits=2, user_api="blas"):
        numba.set_num_threads(2)
        assert p.tick() is None and _blas() == 2 and p.width == 1  # outside a pass nothing is set
        with p.host_pass() as q:
            # beside a busy core: numba's spinning teams get one thread, BLAS one a call in every pass, and the
            # pool's blocking threads every core
            assert q is p and (_blas(), p.width, numba.get_num_threads()) == (1, 2, 1)
            busy["others"] = 0.0
            assert p.tick() == 2 and (_blas(), p.width, numba.get_num_threads()) == (1, 2, 2)  # the neighbour left
            busy["others"] = 1.0
            with p.host_pass():  # nested: decides again, gives back nothing of the outer's
                assert (_blas(), p.width, numba.get_num_threads()) == (1, 2, 1)
            assert _blas() == 1 and numba.get_num_threads() == 2
        assert (_blas(), p.width, numba.get_num_threads()) == (2, 1, 2)
        with pytest.raises(RuntimeError):
            with p.host_pass():
                raise RuntimeError("a failing pass still gives the counts back")
        assert (_blas(), p.width, numba.get_num_threads()) == (2, 1, 2)


def test_agent_lanes_and_host_passes_take_their_counts_from_the_same_policy(monkeypatch):
    from edgeprobe_agent import executor
    from edgeprobe_agent.executor import Context, execute, validate
    from edgeprobe_agent.threads import CORES_IN_USE, Cores
    from edgeprobe_kernels import llama_ops

    monkeypatch.setattr(llama_ops, "SPLIT_HOOK", None)  # enable() installs its hook: given back after the test
    c = Cores(cores=2)
    c.enable()
    assert c.policy is T.POLICY and CORES_IN_USE.policy is not T.POLICY  # the agent's takes POLICY in enable()
    busy = {"others": 1.0}
    monkeypatch.setattr(T.POLICY, "load", lambda: busy["others"])
    monkeypatch.setattr(T.POLICY, "fixed", None)
    monkeypatch.setattr(executor, "CORES_IN_USE", c)
    one_lane = {"ops": [{"name": f"c{i}", "kind": "add", "lane": "cpu", "inputs": [{"input": "x"}, {"input": "x"}]}
                        for i in range(3)], "outputs": ["c2"]}
    plan = validate(one_lane, has_blob=lambda s: False)
    with threadpool_limits(limits=2, user_api="blas"):
        seen = {}
        for others in (1.0, 0.0):
            busy["others"] = others
            _, events = execute(plan, {"x": np.ones((2, 2), np.float32)}, Context(get=None))
            with T.host_pass():
                seen[others] = ({e["threads"] for e in events}, *_counts())
        # a lone lane's op and a host pass: the same count, recorded in each trace event
        assert seen == {1.0: ({1}, 1, T.CORES, 1), 0.0: ({2}, 1, T.CORES, 2)}
        assert c.enter() == 2 and c.enter() == 1  # lanes that overlap keep one core each
        c.leave()
        c.leave()


def test_eval_and_profile_passes_run_inside_the_policy(monkeypatch):
    from edgeprobe import evaluate
    from edgeprobe import forward as forward_module
    from edgeprobe.profile import experts, runner

    monkeypatch.setattr(T.POLICY, "load", lambda: 1.0)  # a neighbour holds a core: passes get one thread
    monkeypatch.setattr(T.POLICY, "fixed", None)
    counts = []

    def fake_forward(model, tokens, **kw):
        counts.append(_counts())
        return np.zeros((len(tokens), 8), np.float32)

    model = SimpleNamespace(config=SimpleNamespace(context_length=64, vocab_size=8, n_experts=1), tokenizer=None,
                            name="fake")
    for module in (evaluate, runner):  # the memory check reads a real config's sizes; this fake has none
        monkeypatch.setattr(module, "check_fits", lambda *a, **k: None)
    with threadpool_limits(limits=2, user_api="blas"):
        numba.set_num_threads(2)
        monkeypatch.setattr(evaluate, "forward", fake_forward)
        evaluate.perplexity(model, np.arange(16) % 8, window=4, max_windows=2, progress=False)
        monkeypatch.setattr(runner, "forward", fake_forward)
        prof = SimpleNamespace(hooks=lambda m: {}, begin_window=lambda c: None, end_window=lambda n: None)
        runner.run(model, np.arange(16), prof, window=4, progress=False)  # calibration, outliers, sparsity
        monkeypatch.setattr(forward_module, "forward", fake_forward)  # record_routing imports it when called
        monkeypatch.setattr(experts, "_RoutingRecorder", lambda m: SimpleNamespace(
            hooks=lambda: {}, take=lambda: (np.zeros((4, 1, 1), np.int16), np.zeros((4, 1, 1), np.float32))))
        trace = experts.record_routing(model, np.arange(8), window=4, progress=False)
        assert trace.tokens == 8 and counts == [(1, T.CORES, 1)] * 8 and _counts() == (2, 1, 2)


def test_unset_or_auto_the_policy_measures_and_a_number_fixes_it(monkeypatch):
    monkeypatch.delenv("EDGEPROBE_THREADS", raising=False)
    assert T.ThreadPolicy(2, load=lambda: 2.0).threads() == 1  # both cores busy elsewhere
    monkeypatch.setenv("EDGEPROBE_THREADS", "auto")
    assert T.ThreadPolicy(2, load=lambda: 2.0).threads() == 1
    monkeypatch.setenv("EDGEPROBE_THREADS", "2")
    assert T.ThreadPolicy(2, load=lambda: 2.0).threads() == 2


@pytest.mark.parametrize("n", [1, 15, 64, 127, 128, 192, 255, 576, 1000, 1536, 2048, 49152, 151936])
@pytest.mark.parametrize("least", [1, 2])
def test_column_blocks_tile_the_output_on_16_column_edges(n, least):
    blocks = T.column_blocks(n, least)
    assert blocks[0][0] == 0 and blocks[-1][1] == n and all(a < b for a, b in blocks)
    assert all(b0[1] == b1[0] for b0, b1 in zip(blocks, blocks[1:]))
    want = max(1, min(T.MAX_BLOCKS, n // T.BLOCK_COLS))
    if least == 2 and 128 <= n < 256:  # a prompt's K or V projection of 192 columns: two blocks, not one core's
        want = 2
    assert all(a % 16 == 0 for a, _ in blocks) and len(blocks) == want


@pytest.mark.parametrize("m, k, n", [(1, 64, 576), (7, 576, 192), (128, 576, 1536), (256, 1536, 576), (64, 96, 49152),
                                     (300, 576, 192)])
def test_matmul_wt_gives_the_same_bits_at_every_width(monkeypatch, m, k, n):
    rng = np.random.default_rng(m + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    ref = (x.astype(np.float64) @ w.astype(np.float64).T)
    with threadpool_limits(limits=1, user_api="blas"):
        ys = []
        for width in (1, 2, 3):
            monkeypatch.setattr(T.POLICY, "width", width)
            ys.append(T.matmul_wt(x, w))
    assert ys[0].dtype == np.float32 and ys[0].shape == (m, n)
    assert all(np.array_equal(ys[0], y) for y in ys[1:])
    if m > T.SMALL_M:  # each block is one BLAS call written in place: the bits of that block's product alone
        with threadpool_limits(limits=1, user_api="blas"):
            blocks = [x @ w[a:b].T for a, b in T.column_blocks(n, 2)]
        assert np.array_equal(ys[0], np.concatenate(blocks, axis=1))
    np.testing.assert_allclose(ys[0], ref, rtol=0, atol=1e-5 * np.sqrt(k) * float(np.abs(ref).max()))


def test_a_host_pass_computes_the_same_bits_whatever_the_count_and_blas_start(monkeypatch, smollm, heldout_ids):
    """Logits and a calibration (the clips and SmoothQuant scales a w8a8 model is quantized from) at a count of 1
    and 2 threads, with numpy's BLAS started at 1 or 2 threads: bit for bit equal, GEMMs, attention blocks and
    SwiGLU rows spread over the threads or not. Before, OpenBLAS's own
    threading gave other roundings at two threads than at one, so a calibration followed the machine's load."""
    from edgeprobe.forward import forward
    from edgeprobe.quant import calibration_profile

    ids = np.asarray(heldout_ids[:300])  # over 256 rows and 64 positions: attention and SwiGLU split their rows too
    runs = []
    for fixed, blas in ((1, 1), (2, 2), (2, 1), (1, 2)):
        monkeypatch.setattr(T.POLICY, "fixed", fixed)
        with threadpool_limits(limits=blas, user_api="blas"):
            logits = forward(smollm, ids)
            prof = calibration_profile(smollm, ids, tokens=256, window=128, progress=False)
        runs.append((logits, prof.clips_at(99.99), prof.smoothquant_scales(), T.POLICY.chosen.copy()))
    logits0, clips0, scales0, _ = runs[0]
    assert np.isfinite(logits0).all() and len(clips0) == 4 * smollm.config.n_layers
    for logits, clips, scales, _ in runs[1:]:
        assert np.array_equal(logits, logits0) and clips == clips0
        assert scales.keys() == scales0.keys() and all(np.array_equal(scales[k], scales0[k]) for k in scales)
    assert runs[-1][3].get(2, 0) > runs[0][3].get(2, 0)  # the two-thread runs did decide two threads


def test_decode_loops_and_in_process_plans_run_inside_the_policy(monkeypatch):
    from edgeprobe import generate as gen
    from edgeprobe.graph import local

    monkeypatch.setattr(T.POLICY, "load", lambda: 1.0)  # a neighbour holds a core: passes get one thread
    monkeypatch.setattr(T.POLICY, "fixed", None)
    counts = []

    def fake_forward(model, tokens, cache=None, **kw):
        counts.append(_counts())
        shape = (len(tokens), 8) if np.ndim(tokens) == 2 else (8,)  # a batch's step: a row a sequence; else "last"
        return np.zeros(shape, np.float32)

    tok = SimpleNamespace(encode=lambda s: [1, 2, 3], decode=lambda ids: "x" * len(ids), eos_id=7)
    model = SimpleNamespace(config=None, tokenizer=tok)
    monkeypatch.setattr(gen, "forward", fake_forward)
    monkeypatch.setattr(gen, "KVCache", lambda config: SimpleNamespace(reorder=lambda idx: None))
    real_execute = local.execute

    def counted_execute(*a, **k):
        counts.append(_counts())
        return real_execute(*a, **k)

    monkeypatch.setattr(local, "execute", counted_execute)
    plan = {"ops": [{"name": "c0", "kind": "add", "lane": "cpu", "inputs": [{"input": "x"}, {"input": "x"}]}],
            "outputs": ["c0"]}
    with threadpool_limits(limits=2, user_api="blas"):
        numba.set_num_threads(2)
        g = gen.generate(model, "abc", n=3, stop_at_eos=False)  # a prefill and two decode steps
        assert g.tokens == [0, 0, 0] and len(counts) == 3
        out = gen.replay(model, [1, 2, 3], np.zeros((2, 2), np.int64))  # a prefill and two steps of a batch of 2
        assert [o.shape for o in out] == [(1, 8), (2, 8), (2, 8)] and len(counts) == 6
        outs, _, _ = local.run_plan(plan, get=None, inputs={"x": np.ones((2, 2), np.float32)})
        np.testing.assert_array_equal(outs["c0"], np.full((2, 2), 2, np.float32))
        assert counts == [(1, T.CORES, 1)] * 7 and _counts() == (2, 1, 2)  # given back after each


def test_only_the_outermost_pass_takes_a_fresh_measurement(monkeypatch):
    # a fresh measurement may idle FIRST_S (80 ms): a plan nested in a decode loop must not pay it per step
    p = T.ThreadPolicy(2, load=lambda: 0.0)
    asked = []
    monkeypatch.setattr(p, "others", lambda fresh=False: asked.append(fresh) or 0.0)
    with p.host_pass():
        for _ in range(3):
            with p.host_pass():
                pass
    with p.host_pass():
        pass
    assert asked == [True, False, False, False, False, True, False]  # and the outermost samples at its exit


def test_a_statistic_runs_beside_the_pass_and_is_done_at_its_exit(monkeypatch):
    """beside(fn) in a pass on two threads: fn runs on the pool's thread while the caller goes on (fn waits for the
    caller's next step: run in turn it would time out), and is done when the pass exits; at one thread it runs at
    once, on the caller's thread."""
    import threading

    monkeypatch.setattr(T.POLICY, "fixed", 2)
    went_on, ran = threading.Event(), []

    def observe():
        ran.append((went_on.wait(10), threading.current_thread().name))
    with T.host_pass():
        T.beside(observe)
        went_on.set()
    assert ran == [(True, ran[0][1])] and ran[0][1].startswith("edgeprobe-gemm")
    monkeypatch.setattr(T.POLICY, "fixed", 1)
    went_on.clear()
    with T.host_pass():
        T.beside(lambda: ran.append(threading.current_thread().name))
        assert ran[-1] == threading.current_thread().name


def test_an_error_beside_a_pass_is_raised_at_its_exit_and_the_pass_s_own_wins(monkeypatch):
    import threading

    monkeypatch.setattr(T.POLICY, "fixed", 2)

    def fails():
        raise ValueError("the statistic failed")
    with pytest.raises(ValueError, match="the statistic failed"):
        with T.host_pass():
            T.beside(fails)
    done = threading.Event()

    def slow_fail():
        time.sleep(0.2)
        done.set()
        raise ValueError("the statistic failed")
    with pytest.raises(KeyError):
        with T.host_pass():
            T.beside(slow_fail)
            raise KeyError("the pass failed")
    assert done.is_set() and getattr(T._PENDING, "future", None) is None  # waited for, nothing left running


def test_a_pass_long_after_the_last_sample_measures_the_present(monkeypatch):
    """A neighbour kept both cores busy from 0.5 s to 4.9 s; a pass starting at 5.0 s measures FIRST_S anew (quiet:
    2 threads), where the average since the last sample (0.5 s) counted the neighbour that had gone (1 thread)."""
    clock, busy_until = [0.0], 4.9

    class Load(T.CpuLoad):
        def sample(self):  # (now, busy CPU-seconds of both CPUs: the neighbour's 2 cores while it ran, ours 0)
            t = clock[0]
            return t, 2 * max(0.0, min(t, busy_until) - 0.5), 0.0
    monkeypatch.setattr(T.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(T.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    p = T.ThreadPolicy(2, load=Load(cpus=[0, 1]), env=False)
    assert p.threads(fresh=True) == 2  # the first pass at 0: FIRST_S of a quiet machine
    clock[0] = 0.5
    assert p.threads() == 2  # sampled at 0.5 (the neighbour starts)
    clock[0] = 2.0
    assert p.threads() == 1  # inside a pass, the neighbour's 1.5 s seen
    clock[0] = 5.0
    assert p.threads(fresh=True) == 2 and p._sample[0] == pytest.approx(5.0 + T.FIRST_S)


def test_the_agent_measures_the_load_over_its_runs_only(monkeypatch):
    """The agent's lanes decide per op from windows that span its runs (Cores.running: resume .. pause). A
    neighbour busy on both cores while the agent waits for its next request (llama.cpp's prefill in a bench's turns)
    is not counted: the run after it keeps both cores. A neighbour busy beside its short runs is, over their summed
    time: a measurement at the first op once the windows since the last one span INTERVAL_S."""
    clock, busy = [0.0], []  # busy: the neighbour's (start, stop) spans on both cores

    class Load(T.CpuLoad):
        def sample(self):
            t = clock[0]
            return t, sum(2 * max(0.0, min(t, b) - a) for a, b in busy), 0.0
    monkeypatch.setattr(T.time, "monotonic", lambda: clock[0])
    p = T.ThreadPolicy(2, load=Load(cpus=[0, 1]), env=False)

    def run(seconds, gap=0.5, ops=8):  # after `gap` s idle, a run whose ops ask for their count as it goes on
        clock[0] += gap
        p.resume()
        got = []
        for _ in range(ops):  # steps of binary fractions of a second: every sum below is exact
            got.append(p.threads())
            clock[0] += seconds / ops
        p.pause()
        return got

    assert run(0.5, gap=0.0) == [2] * 8  # measured quiet at 0.25; 0.25 s carried to the next measurement
    busy.append((0.5, 1.5))  # the neighbour runs while the agent is idle
    # measured at the first op (the carried 0.25 s) and at 1.75: quiet; the old window, 0.25..1.5, had 1.6 cores
    assert run(0.5, gap=1.0) == [2] * 8 and p._others == 0.0
    busy.append((2.0, 9.0))  # from 2.0 on beside every run, and between them
    got = [run(0.125, gap=g) for g in (0.0, 0.5, 0.5)]
    # the first op at 2.0 closes the quiet 0.25 s carried; two runs of 0.125 s beside it make the next 0.25 s
    assert got == [[2] * 8, [2] * 8, [1] * 8] and p._others == 2.0


def test_overlapping_runs_open_one_window_and_the_last_to_end_closes_it():
    """Cores.running around each request's run: resume as the first run starts, pause as the last one ends."""
    from edgeprobe_agent.threads import Cores

    calls = []
    c = Cores(cores=2)
    c.enabled, c.policy = True, SimpleNamespace(resume=lambda: calls.append("resume"),
                                                pause=lambda: calls.append("pause"))
    with c.running():
        with c.running():
            pass
        assert calls == ["resume"]
    with pytest.raises(KeyError):
        with c.running():
            raise KeyError("a failed run")
    assert calls == ["resume", "pause", "resume", "pause"] and c._runs == 0


def test_a_pass_right_after_another_starts_from_the_load_at_its_end(monkeypatch):
    """A host pass samples the load as it exits: the next pass, starting within FIRST_S, takes the load of the
    first pass's last stretch and does not sleep FIRST_S to measure, though the first pass's last tick (its long
    window's start) is over STALE_S old. A neighbour kept both cores from 0.5 s on."""
    clock, slept = [0.0], []

    class Load(T.CpuLoad):
        def sample(self):
            t = clock[0]
            return t, 2 * max(0.0, t - 0.5), 0.0
    monkeypatch.setattr(T.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(T.time, "sleep", lambda s: (slept.append(s), clock.__setitem__(0, clock[0] + s)))
    p = T.ThreadPolicy(2, load=Load(cpus=[0, 1]), env=False)
    with p.host_pass():  # a pass of one 1.6 s window, ticked at its start
        assert p.last == 2 and slept == [T.FIRST_S]
        p.tick()
        clock[0] += 1.6
    clock[0] += 0.01
    with p.host_pass():
        assert slept == [T.FIRST_S] and p.last == 1  # no sleep; the neighbour seen over the first pass's window


def test_a_forked_child_spreads_on_its_own_pool():
    """A child forked after the pool started has none of its threads: without a pool of its own its first split
    would wait forever."""
    import os

    T.spread(lambda part: None, [[0], [1]])  # the parent's pool exists
    pid = os.fork()
    if pid == 0:
        out = np.zeros(2)
        T.spread(lambda part: out.__setitem__(part[0], 1.0), [[0], [1]])
        os._exit(0 if out.tolist() == [1.0, 1.0] else 3)
    import signal
    import time

    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid, "the forked child's split never finished"
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_window_nll_split_over_threads_is_the_one_pass_formula(monkeypatch):
    """Eval's NLL over a window's [T, vocab] logits, in row blocks over the pool: the bits of the whole-array formula
    (logsumexp in float64 minus the target's logit) at every width."""
    from edgeprobe.evaluate import window_nll

    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((200, 3000)) * 4).astype(np.float32)
    ids = rng.integers(0, 3000, 200)
    z = logits[:-1]
    m = z.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(axis=-1, dtype=np.float64)) + m[:, 0]
    want = lse - z[np.arange(199), ids[1:]].astype(np.float64)
    for width in (1, 2, 3):
        monkeypatch.setattr(T.POLICY, "width", width)
        got = window_nll(logits, ids)
        assert got.dtype == np.float64 and np.array_equal(got, want)


def test_a_spread_inside_a_pool_thread_runs_there_instead_of_waiting_on_the_pool(monkeypatch):
    """A weight read inside a spread block (read_tensor shares its row blocks) spreads again: from one of the pool's
    threads it must not wait on the pool (one thread on two cores: it would wait on itself forever)."""
    import threading

    monkeypatch.setenv("EDGEPROBE_THREADS", "2")
    out = np.zeros((4, 4))

    def outer(a, b):
        for i in range(a, b):
            T.run_blocks(lambda c, d: out[i, c:d].__iadd__(i + 1), [(0, 2), (2, 4)])

    def work():
        with T.host_pass():
            T.run_blocks(outer, [(0, 2), (2, 4)])
    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "nested spread deadlocked"
    assert np.array_equal(out, np.repeat(np.arange(1, 5.0)[:, None], 4, axis=1))


def test_a_slowed_thread_takes_fewer_blocks(monkeypatch):
    """run_blocks deals its blocks as threads come free, not in contiguous shares: while the calling thread is held
    on block 0 (a neighbour process has its core) the pool's thread runs every other block. In shares of 4 the
    caller's share holds blocks 1-3, whose completion block 0 waits for: that run would time out."""
    import threading

    monkeypatch.setattr(T.POLICY, "width", 2)
    ran, others_done = {}, threading.Event()

    def block(a, b):
        if a == 0:
            assert others_done.wait(10), "blocks 1-7 waited for the thread held on block 0"
        ran[a] = threading.current_thread().name
        if len(ran) == 7 and 0 not in ran:
            others_done.set()
    T.run_blocks(block, [(i, i + 1) for i in range(8)])
    assert sorted(ran) == list(range(8))
    assert ran[0] == threading.current_thread().name
    assert {ran[i] for i in range(1, 8)} == {ran[1]} and ran[1].startswith("edgeprobe-gemm")


def _at_widths(monkeypatch, fn):
    """fn() with the row splits off (the ops as they were), then split over 1, 2 and 3 threads -> (outputs, the
    largest number of parts a spread ran at each of those four settings)."""
    from edgeprobe_kernels import llama_ops as L

    spread, widest = T.spread, []

    def counted(f, parts):
        widest[-1] = max(widest[-1], len(parts))
        return spread(f, parts)
    monkeypatch.setattr(T, "spread", counted)  # run_blocks' (the statistics)
    monkeypatch.setattr(L, "spread", counted)  # llama_ops._split's
    outs = []
    for splits, width in ((False, 3), (True, 1), (True, 2), (True, 3)):
        monkeypatch.setattr(T, "ROW_SPLITS", splits)
        monkeypatch.setattr(T.POLICY, "width", width)
        widest.append(0)
        outs.append(fn())
    return outs, widest


@pytest.mark.parametrize("rows", [255, 256, 300, 512, 1000, 4100])
def test_row_wise_ops_split_over_threads_give_the_unsplit_bits(monkeypatch, rows):
    """RMS norms (per row and per head), RoPE (one sequence and a batch of two), residual adds and SwiGLU's product
    with their rows in fixed blocks over 1, 2 or 3 threads: the bits of the op run whole on one thread (row splits
    off)."""
    from edgeprobe_kernels import llama_ops as L

    monkeypatch.setattr(L, "SPLIT_HOOK", None)
    monkeypatch.setattr(L, "SPREAD_ELEMENTS", 0)  # every size spreads its blocks (a pass: from 2^20 elements)
    rng = np.random.default_rng(rows)
    x, r, g = (rng.standard_normal((rows, 576), dtype=np.float32) * 3 for _ in range(3))
    w, hw = rng.standard_normal(576, dtype=np.float32), rng.standard_normal(64, dtype=np.float32)
    cos, sin = L.rope_tables(64, 10000.0, 5, rows)

    def ops():
        return (L.rms_norm(x, w, 1e-5), L.head_rms_norm(x, hw, 1e-6, 64),
                L.apply_rope(x.reshape(1, rows, 9, 64), cos, sin), L.add(x, r), L.add(x, r, g),
                L.swiglu_act(x, r), L.apply_rope(np.stack([x, r]).reshape(2, rows, 9, 64), cos, sin))
    outs, widest = _at_widths(monkeypatch, ops)
    # SwiGLU split before from 256 rows (the first setting's spreads are its own); the per-head norm's rows are
    # 9 a token, so it splits at every row count here
    assert widest == [3 if rows >= 256 else 0, 0, 2, 3]
    for got in outs[1:]:
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(outs[0], got))
    # the whole op as numpy computes it: the split changed no formula
    assert np.array_equal(outs[0][3], x + r) and np.array_equal(outs[0][4], x + r + g)
    ms = np.einsum("nc,nc->n", x, x) / 576
    assert np.array_equal(outs[0][0], x * (1.0 / np.sqrt(ms + 1e-5))[:, None].astype(np.float32) * w)


def test_row_blocks_are_a_function_of_the_row_count_and_tile_the_rows():
    from edgeprobe_kernels.llama_ops import FEW_ROWS, row_blocks

    for n in (1, 63, 64, 256, 300, 1000, 4096, 100000):
        blocks = row_blocks(n)
        assert blocks[0][0] == 0 and blocks[-1][1] == n and all(b0[1] == b1[0] for b0, b1 in zip(blocks, blocks[1:]))
        assert len(blocks) <= 16 and (n < 2 * FEW_ROWS or min(b - a for a, b in blocks) > FEW_ROWS)


def test_a_split_deals_growing_blocks_evenly_over_the_threads(monkeypatch):
    """Causal attention's block b costs ~b + 1: dealt back and forth, 8 blocks over 2 threads cost 18 and 18 (dealt
    round-robin, 16 and 20)."""
    from edgeprobe_kernels import llama_ops as L

    monkeypatch.setattr(L, "SPLIT_HOOK", None)
    monkeypatch.setattr(T.POLICY, "width", 2)
    parts = []
    L._split(lambda part: parts.append(list(part)), list(range(8)))
    assert sorted(parts) == [[0, 3, 4, 7], [1, 2, 5, 6]]


@pytest.mark.parametrize("rows, channels", [(300, 576), (512, 1536), (1000, 96), (100, 576)])
def test_profile_statistics_split_over_threads_give_the_unsplit_state(monkeypatch, rows, channels):
    """The outlier profile's per-channel statistics (channel blocks over the threads) and the calibration's |x|
    histogram (row blocks) at 1, 2 and 3 threads: the state the one-thread kernels (and the reference) leave."""
    from edgeprobe_kernels import activation_stats as A

    rng = np.random.default_rng(rows + channels)
    xs = [(rng.standard_normal((rows, channels)) * rng.exponential(1.0, channels)).astype(np.float32)
          for _ in range(2)]
    xs[0][3, 5] = 0.0  # a zero, and a row with no outlier at all
    xs[1][7] = 0.01

    def stats():
        st = [np.zeros(channels, np.float32), np.zeros(channels, np.int64), np.zeros(channels, np.int64),
              np.zeros((channels, A.N_RATIO_BINS), np.int64), np.zeros(channels + 1, np.int64),
              np.zeros(channels, bool)]
        hist = np.zeros(8192, np.int64)
        for x in xs:  # accumulated over two windows
            A.outlier_update(x, 2.5, 6.0, *st)
            A.log2_histogram(x, hist)
        return (*st, hist)
    outs, widest = _at_widths(monkeypatch, stats)
    assert widest == ([0, 0, 2, 3] if rows >= 256 else [0, 0, 0, 0])  # one thread: the blocks in turn, no spread
    ref = [np.zeros(channels, np.float32), np.zeros(channels, np.int64), np.zeros(channels, np.int64),
           np.zeros((channels, A.N_RATIO_BINS), np.int64), np.zeros(channels + 1, np.int64), np.zeros(channels, bool)]
    for x in xs:
        A.outlier_update_ref(x, 2.5, 6.0, *ref)
    for got in outs:
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(outs[0], got))
    assert all(np.array_equal(a, b) for a, b in zip(ref, outs[0]))
    assert outs[0][-1].sum() == 2 * rows * channels and outs[0][4].sum() == 2 * rows


def _side_by_side(n, compute, fixed=2):
    """T.side_by_side over n items in a host pass fixed at `fixed` threads, on a thread of its own (a hang fails the
    test instead of the suite) -> (commits [(i, result)], error raised or None)."""
    import threading

    commits, raised = [], []

    def work():
        try:
            with T.host_pass():
                T.side_by_side(n, compute, lambda i, r: commits.append((i, r)))
        except Exception as e:  # noqa: BLE001  (the test reads it)
            raised.append(e)
    old = T.POLICY.fixed
    T.POLICY.fixed = fixed
    try:
        t = threading.Thread(target=work, daemon=True)
        t.start()
        t.join(60)
    finally:
        T.POLICY.fixed = old
    assert not t.is_alive(), "side_by_side hung"
    return commits, (raised[0] if raised else None)


def test_side_by_side_computes_windows_side_by_side_and_commits_them_in_order():
    """Two computes at once (window 0 waits until window 1 has started: run in turn it would time out), each alone on
    its thread (a spread inside runs there: its blocks are not split; a pass inside runs numba on one thread); the
    commits come in order, each with its own compute's result. A single window spreads its blocks as a pass in turn
    does."""
    import threading

    started = [threading.Event() for _ in range(4)]
    seen = {}

    def compute(i):
        started[i].set()
        if i == 0:
            seen["1 started while 0 ran"] = started[1].wait(10)
        here = []
        T.spread(lambda part: here.append(threading.current_thread().name), [0, 1])
        with T.host_pass():  # a pass inside (forward's own) gives its numba kernels this thread alone
            seen[i] = (T._WORKER.busy, len(set(here)), numba.get_num_threads())
        return i * 10

    commits, err = _side_by_side(4, compute)
    assert err is None and commits == [(0, 0), (1, 10), (2, 20), (3, 30)]
    assert seen["1 started while 0 ran"] is True
    assert all(seen[i] == (True, 1, 1) for i in (0, 1))  # alone: the spread ran both parts on the computing thread
    commits, err = _side_by_side(1, lambda i: (getattr(T._WORKER, "busy", False), i))
    assert err is None and commits == [(0, (False, 0))]  # one window: its blocks spread as in a pass in turn


def test_side_by_side_raises_the_first_error_and_commits_nothing_after_it():
    """A compute's error stops the taking of windows and is raised by side_by_side; the windows before it are committed,
    none after it, and no thread is left waiting for a turn that will not come."""
    taken = []

    def compute(i):
        taken.append(i)
        if i == 2:
            raise ValueError("window 2 is bad")
        return i

    commits, err = _side_by_side(8, compute)
    assert isinstance(err, ValueError) and str(err) == "window 2 is bad"
    assert [i for i, _ in commits] == sorted(i for i, _ in commits) and all(i < 2 for i, _ in commits)
    assert len(taken) < 8  # the windows after it were not all computed


@pytest.mark.parametrize("seed", range(4))
def test_side_by_side_keeps_order_and_finishes_whatever_the_windows_take(seed):
    """Windows that take random times, each spreading blocks inside (run_blocks: on its own thread when alone, over
    the pool for a last window with none beside it): every commit in order with its own window's result, and the
    pass ends (a thread waiting on a commit, or on the pool another thread holds, would hang it)."""
    import time

    rng = np.random.default_rng(seed)
    naps = rng.uniform(0, 0.02, size=(9, 2))

    def compute(i):
        out = np.zeros(4)
        time.sleep(naps[i, 0])
        T.run_blocks(lambda a, b: out[a:b].__iadd__(i), [(0, 2), (2, 4)])
        time.sleep(naps[i, 1])
        return out.sum()

    commits, err = _side_by_side(9, compute)
    assert err is None and commits == [(i, 4.0 * i) for i in range(9)]


@pytest.mark.parametrize("fixed, knob", [(1, True), (2, False)])
def test_at_one_thread_or_with_the_knob_off_side_by_side_is_a_plain_loop(monkeypatch, fixed, knob):
    """One thread, or EDGEPROBE_SIDE_BY_SIDE=0 (threads.SIDE_BY_SIDE, the bench's A/B): every window computed and
    committed in turn on the calling thread."""
    import threading

    monkeypatch.setattr(T, "SIDE_BY_SIDE", knob)
    names = []
    commits, err = _side_by_side(3, lambda i: names.append(threading.current_thread().name) or i, fixed=fixed)
    assert err is None and commits == [(0, 0), (1, 1), (2, 2)] and len(set(names)) == 1


def test_windows_side_by_side_give_the_bits_of_windows_in_turn(monkeypatch, smollm, heldout_ids):
    """At two threads, windows side by side (threads.side_by_side) and in turn: what a profile sees (windows begun,
    hook calls and their values, windows ended, in that order), an outlier profile (its calibration's kept entries
    replayed, then an outlier pass) array for array and a perplexity's NLL, all bit for bit equal; the side by side
    runs did go through side_by_side."""
    from edgeprobe import evaluate
    from edgeprobe.profile import jobs, runner

    ids = np.asarray(heldout_ids[:640])
    monkeypatch.setattr(T.POLICY, "fixed", 2)
    calls = []
    side_by_side = T.side_by_side
    for module in (runner, evaluate):
        monkeypatch.setattr(module, "side_by_side", lambda *a, **k: calls.append(a[0]) or side_by_side(*a, **k))

    def passes():
        seen = []  # what a profile sees, in order: each window's begin and end, and every hook call between
        order = SimpleNamespace(begin_window=lambda c: seen.append(("begin", int(c[0]))),
                                end_window=lambda n: seen.append(("end", n)),
                                hooks=lambda m: {n: lambda name, x: seen.append((name, float(x[-1, -1])))
                                                 for n in ("blk.0.attn_in", "blk.29.ffn_act", "out_norm")})
        runner.run(smollm, ids, order, window=128, progress=False)
        prof = jobs.profile_outliers(smollm, ids, tokens=640, window=128, calib_tokens=256, progress=False)
        nll = evaluate.perplexity(smollm, ids, window=128, max_windows=3, progress=False).nll
        return prof, nll, seen

    side = passes()
    # five windows, the outlier profile's 2 calibration windows and 3 others in one pass (Handover), perplexity (3)
    assert calls == [5, 5, 3] and len(side[2]) == 5 * 5
    monkeypatch.setattr(runner, "side_by_side_budget", lambda: -1)  # no window may keep its activations
    monkeypatch.setattr(evaluate, "fits", lambda *a, **k: False)    # nor two windows' logits fit
    turn = passes()
    assert calls == [5, 5, 3]
    assert side[2] == turn[2] and side[1] == turn[1] and side[0].arrays.keys() == turn[0].arrays.keys()
    for name, fields in turn[0].arrays.items():
        for f, a in fields.items():
            assert np.array_equal(side[0].arrays[name][f], a), (name, f)


@pytest.mark.parametrize("side", [True, False])
def test_a_handover_feeds_two_profiles_from_one_pass_across_the_windows_side_by_side(monkeypatch, smollm,
                                                                                     heldout_ids, side):
    """runner.Handover: windows 0-1 reach the first profile and 2-4 the second, each with its own hook calls in order;
    then() runs once, after the first saw its last window end, and with windows side by side the handover's window
    was computed before it (the pass did not drain there); in turn, before it. A then() that raises stops the pass
    with its error and no window past the handover is seen; a second profile hooking what the first does not is
    refused in one line."""
    from edgeprobe.profile import runner

    ids = np.asarray(heldout_ids[:640])
    monkeypatch.setattr(T.POLICY, "fixed", 2)
    if not side:
        monkeypatch.setattr(runner, "side_by_side_budget", lambda: -1)
    done, real = [], runner.forward
    monkeypatch.setattr(runner, "forward", lambda m, chunk, **k: (real(m, chunk, **k), done.append(int(chunk[0])))[0])

    def seer(names):
        seen = []
        return seen, SimpleNamespace(begin_window=lambda c: seen.append(("begin", int(c[0]))),
                                     end_window=lambda n: seen.append(("end", n)),
                                     hooks=lambda m: {n: lambda name, x: seen.append((name, float(x[-1, -1])))
                                                      for n in names})
    names = ("blk.0.attn_in", "blk.29.ffn_act")
    (first_seen, first), (second_seen, second) = seer(names), seer(names[1:])
    at_then = []

    def then(p):
        at_then.append((p, list(first_seen), len(done)))
        return second
    h = runner.run(smollm, ids, runner.Handover(first, 2, then), window=128, progress=False)
    assert h.second is second and len(at_then) == 1 and at_then[0][0] is first
    starts = [int(ids[w * 128]) for w in range(5)]
    assert [e[1] for e in first_seen if e[0] == "begin"] == starts[:2] and at_then[0][1] == first_seen
    assert first_seen[-1] == ("end", 128) and len(first_seen) == 2 * 4
    assert [e[1] for e in second_seen if e[0] == "begin"] == starts[2:] and len(second_seen) == 3 * 3
    assert at_then[0][2] >= 3 if side else at_then[0][2] == 2
    # the same values as a plain pass's: the hooks' calls went to the profile of their window
    all_seen, plain = seer(names)
    runner.run(smollm, ids, plain, window=128, progress=False)
    assert first_seen == all_seen[:8] and second_seen == [e for e in all_seen[8:] if e[0] != names[0]]

    stopped_seen, stopped = seer(names)
    with pytest.raises(KeyError, match="stop here"):
        runner.run(smollm, ids, runner.Handover(stopped, 2, lambda p: {}["stop here"]), window=128, progress=False)
    assert [e[1] for e in stopped_seen if e[0] == "begin"] == starts[:2]
    with pytest.raises(ValueError, match="Handover keeps per-window state .* profile it with order='window'"):
        runner.run(smollm, ids, runner.Handover(seer(names)[1], 2, then), window=128, order="layer", progress=False)
    wider = seer(names + ("out_norm",))[1]
    with pytest.raises(ValueError, match="second profile hooks \\['out_norm'\\], which the first does not"):
        runner.run(smollm, ids, runner.Handover(seer(names)[1], 2, lambda p: wider), window=128, progress=False)
