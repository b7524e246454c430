"""Profiles sharded over a real Ray cluster (`ray start --head` on 127.0.0.1, the session's ray_cluster fixture):
the CLI's summary equals the single-process run's, every profile kind merges to one pass, and a worker killed in the
middle of a shard is retried by Ray with the result still exact.

Ray's workers run one BLAS thread each (Ray sets OMP_NUM_THREADS to a task's CPUs), and OpenBLAS rounds float32
GEMMs differently with one thread than with two, so a default single-process run here differs from the workers' in
the last bits of the activations: the per-channel maxima move by up to ~2e-5 relative, the counts did not. The
summary is compared as the issue asks (counts exactly, floats to 1e-6 relative); profiles are compared bit for bit
against a reference pass held to one BLAS thread (threadpoolctl), which isolates what sharding and merging do.
"""
import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgeprobe.errors import ClusterError
from edgeprobe.profile import jobs
from edgeprobe.profile.cluster import RayRunner
from edgeprobe.profile.runner import run

W = 64  # small windows keep the suite fast


def _cli(args, env, timeout=600):
    r = subprocess.run([sys.executable, "-m", "edgeprobe", *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    return r


def _same_summary(a, b, path="summary"):
    """Counts (ints, strings, lists of them) exactly; floats to 1e-6 relative."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same_summary(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_summary(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert (np.isnan(a) and np.isnan(b)) or abs(a - b) <= 1e-6 * max(abs(a), abs(b)), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _same_profile(a, b):
    """Same model, settings, windows in the same order; integer arrays exactly; float arrays to the rounding of
    summing shard totals in another order (sums) or exactly (maxima)."""
    assert type(a) is type(b) and a.params == b.params and a.model_sha256 == b.model_sha256
    assert (a.tokens, a.windows, a.corpus_sha256) == (b.tokens, b.windows, b.corpus_sha256)
    assert a.arrays.keys() == b.arrays.keys()
    for t in a.arrays:
        assert a.arrays[t].keys() == b.arrays[t].keys()
        for f, x in a.arrays[t].items():
            y = b.arrays[t][f]
            if x.dtype.kind in "iub" or a.FIELDS.get(f) == "max":
                np.testing.assert_array_equal(x, y, err_msg=f"{t}|{f}")
            else:
                np.testing.assert_allclose(x, y, rtol=1e-12, atol=0, err_msg=f"{t}|{f}")


def _one_thread():
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")  # the arithmetic of a Ray worker (one CPU per task)


@pytest.fixture(scope="module")
def train_ids(smollm):
    from edgeprobe.corpus import read_corpus

    return smollm.tokenizer.encode(read_corpus("train")[:20000])


def test_cli_profile_on_ray_equals_the_single_process_run(ray_cluster, tmp_path):
    env = ray_cluster["env"]
    base = ["profile", "outliers", "--tokens", str(4 * W), "--window", str(W), "--json"]
    one = _cli(base + ["--out", str(tmp_path / "one"), "--no-progress"], env)
    assert one.returncode == 0, one.stderr[-3000:]
    # through Ray Client (ray://), as from a laptop outside the cluster; the in-process tests join its GCS address.
    # Each shard layer-major: the same statistics as the one window-major process (layer-major = window-major)
    on_ray = _cli(base + ["--out", str(tmp_path / "ray"), "--ray", ray_cluster["client"], "--shards", "4",
                          "--order", "layer"], env)
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    a = json.loads((tmp_path / "one" / "summary.json").read_text())
    b = json.loads((tmp_path / "ray" / "summary.json").read_text())
    _same_summary(a, b)
    assert b["tokens"] == 4 * W and b["windows"] == 4
    printed = json.loads(on_ray.stdout.strip().splitlines()[-1])
    assert printed["ray"]["address"] == ray_cluster["client"] and printed["ray"]["shards"] == 8
    assert "outliers on ray" in on_ray.stderr  # the progress bar over shards
    shards = json.loads((tmp_path / "ray" / "shards.json").read_text())["shards"]
    # calibration, then the profile: each pass cut into 4 shards of one window, every window once, in order
    assert [(s["index"], s["first"], s["last"]) for s in shards] == [(i, i, i + 1) for i in range(4)] * 2
    assert all(s["seconds"] > 0 and s["answer_bytes"] > 0 for s in shards)
    # counts exactly; the per-channel maxima only to BLAS's rounding of 1 against 2 threads (module doc)
    from edgeprobe.profile import OutlierStats

    x, y = OutlierStats.load(tmp_path / "one" / "outliers.npz"), OutlierStats.load(tmp_path / "ray" / "outliers.npz")
    assert x.params == y.params and x.corpus_sha256 == y.corpus_sha256
    for t in x.arrays:
        for f in ("count", "count_fixed", "hist", "tok_hist", "win_channels"):
            np.testing.assert_array_equal(x.arrays[t][f], y.arrays[t][f], err_msg=f"{t}|{f}")
        np.testing.assert_allclose(x.arrays[t]["chmax"], y.arrays[t]["chmax"], rtol=1e-4)


def test_every_profile_kind_sharded_on_ray_equals_one_pass(ray_cluster, smollm, train_ids):
    import dataclasses

    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.profile import OutlierStats
    from edgeprobe.profile.experts import CoActivationStats
    from edgeprobe.profile.outliers import tensor_names

    moe = models.load("tiny-moe")
    moe_ids = moe.tokenizer.encode(read_corpus("train")[:20000])
    toy = dataclasses.replace(smollm, name="", source="built in memory")  # no checkpoint a worker could load
    with _one_thread():  # a co-activation profile that has seen a window already: both ways add to it
        seen = run(moe, moe_ids[-W:], CoActivationStats.for_model(moe), window=W, progress=False)
    # the driver's own passes (sparsity's one-window calibration) held to the workers' one thread too
    with _one_thread(), RayRunner(ray_cluster["address"], shards=3, say=lambda m: None) as on_ray:
        got = {"outliers": jobs.profile_outliers(smollm, train_ids, 5 * W, W, progress=False, runner=on_ray),
               "sparsity": jobs.profile_sparsity(smollm, train_ids, 5 * W, W, progress=False, runner=on_ray),
               "coactivation": on_ray(moe, moe_ids, copy.deepcopy(seen), window=W, max_tokens=5 * W, progress=False)}
        with pytest.raises(ClusterError, match="not loaded from a checkpoint"):  # a model built in memory
            on_ray(toy, np.arange(2 * W) % 64, OutlierStats.for_model(toy, {n: 1.0 for n in tensor_names(toy)}),
                   window=W)
        # a path that holds another checkpoint where the worker looks: it stops the pass and says so
        elsewhere = dataclasses.replace(smollm, name="", source=str(models.resolve("tiny-moe")))
        with pytest.raises(ClusterError, match=r"shard 0 .* failed on the cluster: the model .* the driver's has"):
            on_ray(elsewhere, train_ids, got["outliers"].empty(), window=W, max_tokens=W, progress=False)
    assert len(on_ray.reports) == 4 * 3  # outliers: calibration + profile; sparsity; co-activation
    with _one_thread():
        want = {"outliers": jobs.profile_outliers(smollm, train_ids, 5 * W, W, progress=False),
                "sparsity": jobs.profile_sparsity(smollm, train_ids, 5 * W, W, progress=False),
                "coactivation": run(moe, moe_ids, copy.deepcopy(seen), window=W, max_tokens=5 * W, progress=False)}
    assert got["coactivation"].windows == 1 + 5
    for kind in want:
        _same_profile(got[kind], want[kind])
    _same_summary(got["outliers"].summary(), want["outliers"].summary())
    _same_summary(got["sparsity"].summary(), want["sparsity"].summary())
    _same_summary(got["coactivation"].summary(), want["coactivation"].summary())


def _our_shard_processes(head_pid: int) -> list[int]:
    """PIDs of this cluster's workers that are running a shard now (Ray titles a busy worker ray::<task>)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "cmdline").read_bytes().split(b"\0")[0] != b"ray::profile_shard":
                continue
            pid = int(d.name)
            while pid > 1 and pid != head_pid:  # a descendant of our `ray start`, not another cluster's
                pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if pid == head_pid:
            found.append(int(d.name))
    return found


def test_a_worker_killed_mid_shard_is_retried_and_the_profile_is_still_exact(ray_cluster, smollm, train_ids):
    out, errors = {}, []
    with RayRunner(ray_cluster["address"], shards=6, say=lambda m: None) as on_ray:
        def work():
            try:
                out["st"] = jobs.profile_outliers(smollm, train_ids, 6 * W, W, progress=False, runner=on_ray)
            except BaseException as e:  # handed to the test's thread
                errors.append(e)

        t = threading.Thread(target=work)
        t.start()
        victim, deadline = None, time.monotonic() + 120
        while victim is None and t.is_alive() and time.monotonic() < deadline:
            busy = _our_shard_processes(ray_cluster["pid"])
            if busy:
                victim = busy[0]
                killed_at = time.time()
                os.kill(victim, signal.SIGKILL)
            time.sleep(0.01)
        t.join(timeout=600)
    assert victim is not None, "no worker was seen running a shard"
    assert not errors, errors
    with _one_thread():
        want = jobs.profile_outliers(smollm, train_ids, 6 * W, W, progress=False)
    assert out["st"] == want  # every array bit for bit: nothing lost, nothing counted twice
    reports = on_ray.reports
    assert [r.index for r in reports] == list(range(6)) * 2  # every shard of both passes answered once
    # the shard the victim was running was answered by another worker: whatever the victim reported ended before
    # the kill, and it is gone
    assert all(r.started + r.seconds < killed_at for r in reports if r.pid == victim)
    assert not Path(f"/proc/{victim}").exists() or "Z" in Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1][:3]


def test_bad_ray_input_is_a_clear_error(tmp_path, free_port):
    base = ["profile", "outliers", "--tokens", str(2 * W), "--window", str(W), "--out", str(tmp_path / "o")]
    env = {**os.environ}
    for extra, msg in ((["--shards", "2"], "add --ray local"),
                       (["--ray", f"127.0.0.1:{free_port()}"], "no Ray cluster answers at 127.0.0.1:"),
                       (["--ray", "nowhere"], "write local, auto, HOST:PORT"),
                       (["--ray", "local", "--shards", "0"], "--shards must be a positive number")):
        t0 = time.monotonic()
        r = _cli(base + extra, env, timeout=120)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr[-2000:])
        assert time.monotonic() - t0 < 60  # said at once, never after Ray's minute of retries
