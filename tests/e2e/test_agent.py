"""The device agent as a real process on a real ZeroMQ socket: upload, plans, runs, traces, and every way a
message, a connection or the agent itself can go wrong."""
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from edgeprobe.device import AgentLostError, Device, DeviceError
from edgeprobe.plan import prefill_plan
from edgeprobe.trace import Trace, cosine
from edgeprobe_agent.protocol import PROTOCOL_VERSION


@pytest.fixture(scope="module")
def qm(smollm):
    from edgeprobe.corpus import read_corpus
    from edgeprobe.quant import calibration_profile, quantize

    prof = calibration_profile(smollm, smollm.tokenizer.encode(read_corpus("train")), tokens=512, window=256,
                               progress=False)
    return quantize(smollm, "w8a8-shadow", prof)


def test_hello_reports_the_device(dev):
    h = dev.info
    assert h["protocol"] == PROTOCOL_VERSION and h["agent_version"]
    assert {"cpu", "npu"} <= set(h["lanes"]) and h["emulated_lanes"] == ["npu"]
    assert h["cores"] >= 1 and h["memory_bytes"] > 0 and isinstance(h["opencl"], list)
    # host and agent read one monotonic clock here: each reply's clock lies between its request and its reply
    for _ in range(3):
        t0 = time.perf_counter_ns() / 1e3
        h, _ = dev.request("heartbeat")
        assert t0 <= h["clock_us"] <= time.perf_counter_ns() / 1e3


def test_the_clock_offset_is_the_agents_clock_minus_the_hosts(dev, monkeypatch):
    """An agent 5 s ahead (a phone's clock): the offset found from the round trips is +5 s, to within one of them."""
    def ahead(op, *a, **k):
        assert op == "heartbeat"
        return {"clock_us": time.perf_counter_ns() / 1e3 + 5e6}, []

    monkeypatch.setattr(dev, "request", ahead)
    assert dev._align_clock() == pytest.approx(5e6, abs=1e4)


def test_the_agent_raises_its_open_file_limit_for_its_mappings(tmp_path):
    # each mapped blob or layout holds a descriptor (~380 after a w8a8-shadow prefill): under a soft limit of 1024
    # the fifth scheme loaded in one agent failed its run with EMFILE
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.fail(f"this machine's hard limit on open files is {hard}; the agent needs 4096 (raise it: ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # the usual default, inherited by the agent
    try:
        dev = Device.local(store=tmp_path / "flash")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with dev:
        limits = open(f"/proc/{dev.process.pid}/limits").read()
        status = open(f"/proc/{dev.process.pid}/status").read()
        info = dev.info["files"]
    agent_soft = int(next(l for l in limits.splitlines() if l.startswith("Max open files")).split()[3])
    table = int(next(l for l in status.splitlines() if l.startswith("FDSize")).split()[1])
    assert agent_soft == info["limit"] >= 4096 and table >= info["table"] == 4096


def test_a_warm_prefill_reuses_the_agents_heap_instead_of_faulting_in_fresh_pages(dev, qm, heldout_ids):
    # glibc here: the agent's malloc keeps arrays below 64 MB in one arena's heap (edgeprobe_agent/__main__.py);
    # with glibc's defaults a warm 48-token prefill faulted ~13,600 pages, each activation mmapped and unmapped
    def minor_faults():
        return int(open(f"/proc/{dev.process.pid}/stat").read().rsplit(")", 1)[1].split()[7])
    assert dev.info["malloc"] == {"MALLOC_ARENA_MAX": 1, "MALLOC_MMAP_THRESHOLD_": 64 << 20,
                                  "MALLOC_TRIM_THRESHOLD_": 256 << 20, "MALLOC_TOP_PAD_": 64 << 20}
    toks = heldout_ids[:48]
    for _ in range(2):
        dev.prefill(qm, toks, progress=False)
    before = minor_faults()
    dev.prefill(qm, toks, progress=False)
    assert minor_faults() - before < 1000


def test_prefill_on_the_agent_matches_the_host_and_traces_both_lanes(dev, qm, smollm, heldout_ids, independent_linear,
                                                                    tmp_path):
    from edgeprobe.forward import forward

    toks = heldout_ids[:48]
    res = dev.prefill(qm, toks, progress=False)
    host = qm.forward(toks)[-1]
    assert res.logits.shape == (1, qm.model.config.vocab_size)
    assert cosine(res.logits[0], host) >= 0.999  # the host's simulation: the agent's own kernels, composed by forward()
    # independent: mllm-NPU eq. 1 recomputed in numpy from the float weights and the manifest's scales
    # (tests/conftest.py). Per-tensor int8 amplifies one ulp (a 2e-7 relative nudge of every linear moves this
    # cosine by up to 1e-2), so the reference rounds codes and sums the shadow outliers in float32 as the device
    # does (tests/conftest.py)
    ref = forward(smollm, toks, linear=independent_linear(qm, smollm), logits="last")
    flt = forward(smollm, toks, logits="last")
    got = res.logits[0]
    cos_ref, near = cosine(got, ref), np.linalg.norm(got - ref) / np.linalg.norm(got - flt)
    # centred: softmax ignores a common offset, raw cosine does not
    cos_flt = cosine(got - got.mean(), flt - flt.mean())
    print(f"\nw8a8-shadow prefill on the agent: cosine vs the numpy reference {cos_ref:.7f}, |agent - reference| = "
          f"{near:.1e} x |agent - float|, centred cosine vs float {cos_flt:.4f}")
    assert cos_ref >= 0.9999
    # the agent ran the int8 scheme, not float: all of its distance from float is the scheme's (6e-7 seen) ...
    assert near < 0.02
    # ... and shadow outliers keep per-tensor int8 close to float (0.979 seen; plain W8A8 falls much further)
    assert cos_flt > 0.95
    m = res.trace.metrics()
    assert m["lanes"]["npu"]["ops"] == 7 * 30 and m["lanes"]["npu"]["emulated"] and not m["lanes"]["cpu"]["emulated"]
    assert 0 < m["lanes"]["npu"]["busy_pct"] <= 100 and m["makespan_ms"] > 0
    # lanes really overlap: some cpu op runs while an npu op runs
    ev = res.trace.events
    npu = [(e["start_us"], e["end_us"]) for e in ev if e["lane"] == "npu"]
    cpu = [(e["start_us"], e["end_us"]) for e in ev if e["lane"] == "cpu"]
    assert any(a < d and c < b for a, b in npu for c, d in cpu)
    path = res.trace.to_chrome_json(tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "npu (emulated on CPU)" in names
    assert any(e["ph"] == "s" for e in doc["traceEvents"]) and any(e["ph"] == "X" for e in doc["traceEvents"])
    assert res.trace.figure().data
    again = dev.prefill(qm, toks, progress=False)  # nothing to upload the second time
    assert np.array_equal(again.logits, res.logits)
    Trace.load(res.trace.save(tmp_path / "t.json"))


def test_a_warm_prefill_sends_only_its_run_and_a_forgetful_agent_is_served_again(dev, qm, heldout_ids):
    toks = heldout_ids[:16]
    first = dev.prefill(qm, toks, progress=False)
    sent, send = [], dev.send
    dev.send = lambda op, *a, **kw: (sent.append(op), send(op, *a, **kw))[1]
    try:
        again = dev.prefill(qm, toks, progress=False)
        assert [op for op in sent if op != "heartbeat"] == ["run"]  # no upload check, load_model or put_plan
        assert np.array_equal(again.logits, first.logits)
        # an agent that lacks the plan the client remembers (one restarted behind the same address): the client
        # hears unknown_plan, forgets, and loads and puts the plan again
        plans = dev._known[id(qm)]["plans"]
        for key in plans:
            plans[key] = "0" * 16
        sent.clear()
        third = dev.prefill(qm, toks, progress=False)
        assert [op for op in sent if op != "heartbeat"] == ["run", "has_blobs", "load_model", "put_plan", "run"]
        assert np.array_equal(third.logits, first.logits)
    finally:
        dev.send = send


def test_bad_plans_get_error_replies(dev, qm):
    plan = prefill_plan(qm.manifest, 8)
    bad_blob = json.loads(json.dumps(plan))
    bad_blob["ops"][0]["inputs"][1] = {"blob": "f" * 64}
    with pytest.raises(DeviceError, match="missing_blob"):
        dev.put_plan(bad_blob)
    unknown = {"ops": [{"name": "a", "kind": "fft", "lane": "cpu", "inputs": []}]}
    with pytest.raises(DeviceError, match="unknown_op"):
        dev.put_plan(unknown)
    cycle = {"ops": [{"name": "a", "kind": "add", "lane": "cpu", "inputs": [{"op": "b"}]},
                     {"name": "b", "kind": "add", "lane": "cpu", "inputs": [{"op": "a"}]}]}
    with pytest.raises(DeviceError, match="cycle"):
        dev.put_plan(cycle)
    lane_deadlock = {"ops": [{"name": "a", "kind": "add", "lane": "cpu", "inputs": [{"input": "x"}]},
                             {"name": "b", "kind": "add", "lane": "cpu", "inputs": [{"op": "a"}]}],
                     "lane_order": {"cpu": ["b", "a"]}}
    with pytest.raises(DeviceError, match="cycle"):
        dev.put_plan(lane_deadlock)
    with pytest.raises(DeviceError, match="unknown_lane"):
        dev.put_plan({"ops": [{"name": "a", "kind": "add", "lane": "dsp", "inputs": []}]})
    ok = dev.put_plan({"ops": [{"name": "a", "kind": "add", "lane": "cpu",
                                "inputs": [{"input": "x"}, {"input": "x"}]}]})
    r = dev.run(ok, {"x": np.ones((2, 3), np.float32)})
    assert np.array_equal(r.logits, np.full((2, 3), 2, np.float32))
    with pytest.raises(DeviceError, match="missing_input"):
        dev.run(ok, {"y": np.ones(2, np.float32)})
    assert dev.hello()["protocol"] == PROTOCOL_VERSION


def test_upload_cut_midway_resumes_with_missing_chunks_only(tmp_path):
    rng = np.random.default_rng(0)
    blob = rng.standard_normal(300_000).astype(np.float32)  # 1.2 MB: 5 chunks of 256 kB
    raw = blob.tobytes()
    sha = hashlib.sha256(raw).hexdigest()
    cb = 256 * 1024
    n = -(-len(raw) // cb)
    with Device.local(store=tmp_path / "s") as dev:
        for i in (0, 2, 3):  # the connection "dies" after three chunks
            piece = np.frombuffer(raw[i * cb:(i + 1) * cb], np.uint8)
            dev.request("put_blob", [piece], sha=sha, dtype="float32", shape=[300_000], nbytes=len(raw), chunk=i,
                        n_chunks=n, chunk_bytes=cb, chunk_crc32=zlib.crc32(piece))
        bad = np.frombuffer(raw[cb:2 * cb], np.uint8)
        with pytest.raises(DeviceError, match="chunk_checksum"):
            dev.request("put_blob", [bad], sha=sha, dtype="float32", shape=[300_000], nbytes=len(raw), chunk=1,
                        n_chunks=n, chunk_bytes=cb, chunk_crc32=12345)
    assert not (tmp_path / "s" / "blobs" / sha).exists()  # no blob under its name until it is whole
    with Device.local(store=tmp_path / "s") as dev:  # a new agent process, the same flash
        h, _ = dev.request("has_blobs", ids=[sha])
        assert h["have"] == [] and h["partial"][sha] == [0, 2, 3]

        class OneBlob:  # the smallest QuantizedModel-like object upload() needs
            manifest = {"blobs": {sha: {"nbytes": len(raw)}}}

            class store:
                get = staticmethod(lambda s: blob)
        sent = dev.upload(OneBlob, progress=False, chunk_bytes=cb)
        assert sent == len(raw) - 3 * cb  # chunks 1 and 4 only
        assert dev.request("has_blobs", ids=[sha])[0]["have"] == [sha]
    stored = np.fromfile(tmp_path / "s" / "blobs" / sha, np.float32)
    assert np.array_equal(stored, blob)


def test_a_killed_agent_makes_the_client_raise_not_hang(tmp_path, slow_plan):
    dev = Device.local(store=tmp_path / "k")
    # 4,000 reads of a 64 MB matrix: seconds on any machine (20,000 adds of 256 x 256 ended within 0.3 s on one)
    plan, inputs = slow_plan(4000)
    pid = dev.put_plan(plan)
    rid = dev.send("run", list(inputs.values()), plan_id=pid, inputs=list(inputs))
    time.sleep(0.3)
    proc, dev.process = dev.process, None  # as for a remote agent: only the heartbeat can tell
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(AgentLostError, match="heartbeat"):
        dev.wait(rid)
    assert time.monotonic() - t0 < 10
    proc.wait(timeout=5)
    dev.sock.close(0)


def test_cancel_stops_a_run(dev, slow_plan):
    plan, inputs = slow_plan(4000)  # seconds on any machine: the cancel comes while it runs
    pid = dev.put_plan(plan)
    rid = dev.send("run", list(inputs.values()), plan_id=pid, inputs=list(inputs))
    time.sleep(0.2)
    dev.request("cancel", target=rid)
    with pytest.raises(DeviceError, match="cancelled"):
        dev.wait(rid)


def test_binding_off_loopback_needs_curve_keys(tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgeprobe_agent", "--bind", "tcp://0.0.0.0:0", "--store", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "CURVE" in r.stderr
    import zmq.auth

    keys = tmp_path / "keys"
    keys.mkdir()
    pub_file, _ = zmq.auth.create_certificates(str(keys), "server")
    server_public, _ = zmq.auth.load_certificate(pub_file)
    p = subprocess.Popen([sys.executable, "-m", "edgeprobe_agent", "--bind", "tcp://0.0.0.0:*", "--store",
                          str(tmp_path / "st"), "--curve-keys", str(keys)], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        port = line.strip().rsplit(":", 1)[1]
        dev = Device.connect(f"tcp://127.0.0.1:{port}", curve_server_key=server_public)
        assert dev.info["protocol"] == PROTOCOL_VERSION
        dev.close(shutdown=True)
        p.wait(timeout=10)
    finally:
        p.kill()


def test_run_cli_on_a_local_agent(tmp_path):
    trace = tmp_path / "trace.json"
    r = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--model", "smollm2-135m", "--scheme", "w8a8-shadow",
                        "--prompt-len", "32", "--device", "local", "--trace", str(trace), "--json", "--no-progress"],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "EDGEPROBE_AGENT_STORE": str(tmp_path / "st")})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["logits_cosine_vs_host"] >= 0.999 and out["tokens"] == 32
    assert out["tok_per_s"] > 0 and out["makespan_ms"] > 0 and out["upload_bytes"] > 50e6
    # each lane's busy share is the union of its events over the makespan, recomputed from the trace it wrote
    events = json.loads(trace.read_text())["traceEvents"]
    lane_of = {e["tid"]: e["args"]["name"].split(" ")[0] for e in events if e["name"] == "thread_name"}
    ops = [(lane_of[e["tid"]], e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X"]
    timed = [o for o in ops if o[0] != "io"]
    span = max(b for _, _, b in timed) - min(a for _, a, _ in timed)
    busy = {}
    for lane in {o[0] for o in ops}:
        total, end = 0.0, -math.inf
        for _, a, b in sorted(o for o in ops if o[0] == lane):
            total, end = total + max(0.0, b - max(a, end)), max(end, b)
        busy[lane] = 100 * total / span
    assert set(out["lanes"]) == set(busy) >= {"cpu", "npu"} and out["lanes"]["npu"] > 0
    assert all(out["lanes"][k] == pytest.approx(busy[k], abs=0.01) for k in busy), (out["lanes"], busy)
    assert out["makespan_ms"] == pytest.approx(span / 1e3, rel=1e-6)
    bad = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--device", "udp://x", "--prompt-len", "8"],
                         capture_output=True, text=True, timeout=900)
    assert bad.returncode == 2 and "--device" in bad.stderr and "Traceback" not in bad.stderr


def test_opencl_gemms_are_exact_where_integer():
    from edgeprobe_kernels.opencl_gemm import OpenCLGemm

    g = OpenCLGemm()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 70)).astype(np.float32)
    w = rng.standard_normal((13, 70)).astype(np.float32)
    assert np.allclose(g.gemm_f32(x, w), x @ w.T, atol=1e-4)
    w16 = w.astype(np.float16)
    assert np.allclose(g.gemm_f16w(x, w16), x @ w16.astype(np.float32).T, atol=1e-4)
    a = rng.integers(-128, 128, (9, 600), dtype=np.int8)
    b = rng.integers(-128, 128, (5, 600), dtype=np.int8)
    assert np.array_equal(g.gemm_s8s32(a, b), a.astype(np.int64) @ b.astype(np.int64).T)


def test_gpu_lane_runs_w4a16_linears_in_opencl(dev, smollm, heldout_ids, independent_linear):
    from edgeprobe.forward import forward
    from edgeprobe.quant import quantize

    assert "gpu" in dev.info["lanes"], "PoCL (Debian pocl-opencl-icd) and pyopencl are installed by make test"
    qm = quantize(smollm, "q4_0")
    toks = heldout_ids[:24]
    res = dev.prefill(qm, toks, progress=False, float_lane="gpu")
    assert cosine(res.logits[0], qm.forward(toks, logits="last")) >= 0.999
    # independent: Q4_0 weights through gguf-py's own quantizer and dequantizer (not our vlut16 kernel), activations
    # rounded to FP16; the OpenCL kernels sum in another order and keep FP16 products, hence 1e-4, not exact
    ref = forward(smollm, toks, linear=independent_linear(qm, smollm), logits="last")
    flt = forward(smollm, toks, logits="last")
    got = res.logits[0]
    cos_ref, near = cosine(got, ref), np.linalg.norm(got - ref) / np.linalg.norm(got - flt)
    cos_flt = cosine(got - got.mean(), flt - flt.mean())  # centred: softmax ignores a common offset
    print(f"\nq4_0 prefill on the gpu lane: cosine vs the gguf reference {cos_ref:.7f}, |agent - reference| = "
          f"{near:.1e} x |agent - float|, centred cosine vs float {cos_flt:.4f}")
    # the lane computed Q4_0 (2e-3 seen: FP16 products), not float; 4-bit weights still rank like float (0.938 seen)
    assert cos_ref >= 0.9999 and near < 0.02 and cos_flt > 0.85
    m = res.trace.metrics()
    assert m["lanes"]["gpu"]["ops"] == 7 * 30 and not m["lanes"]["gpu"]["emulated"]
    # Q4_0 in the npu lane's tile order (q4_0-tile), its linears placed on the gpu lane by hand: dequantized there
    # to the FP16 weights the npu lane reads
    from edgeprobe.plan import prefill_plan

    tiled = quantize(smollm, "q4_0-tile")
    plan = prefill_plan(tiled.manifest, len(toks))
    for op in plan["ops"]:
        op["lane"] = "gpu" if op["lane"] == "npu" else op["lane"]
    dev.upload(tiled, progress=False)
    dev.load_model(tiled)
    got_t = dev.run(dev.put_plan(plan), {"tokens": np.asarray(toks, np.int32)})
    # OpenCL's W4A16 sums in its own order and keeps FP16 products, the host BLAS's: max |diff| / max |logit| 4e-4
    # seen; the float model is far further
    host_t = tiled.forward(toks, logits="last")
    assert np.abs(got_t.logits[0] - host_t).max() < 2e-3 * np.abs(host_t).max()
    assert np.abs(got_t.logits[0] - flt).max() > 10 * np.abs(got_t.logits[0] - host_t).max()
    assert got_t.trace.metrics()["lanes"]["gpu"]["ops"] == 7 * 30
    df = res.trace.to_dataframe()
    assert set(df["lane"]) >= {"gpu", "cpu"} and (df["dur_ms"] >= 0).all()


def test_memory_budget_evicts_and_every_flash_read_is_traced(tmp_path):
    from edgeprobe_agent.store import FlashStore, StoreError

    reads = []
    st = FlashStore(tmp_path / "f", memory_budget=3000, on_read=reads.append)
    blobs = [np.full(250, i, np.float32) for i in range(4)]  # 1000 bytes each: 3 fit
    shas = []
    for b in blobs:
        raw = b.tobytes()
        sha = hashlib.sha256(raw).hexdigest()
        assert st.put_chunk(sha, "float32", [250], len(raw), 0, 1, 1 << 20, zlib.crc32(raw), raw)
        shas.append(sha)
    for s in shas:  # 4 cold reads; the first blob is evicted by the fourth
        st.get(s)
    assert len(reads) == 4 and st.stats()["resident_bytes"] == 3000
    st.get(shas[3])
    assert len(reads) == 4  # resident: no read
    assert np.array_equal(st.get(shas[0]), blobs[0]) and len(reads) == 5  # evicted: read from flash again
    assert not st.get(shas[0]).flags.writeable  # mapped from the blob's file: never written through
    assert all(e["kind"] == "flash_read" and e["bytes_in"] == 1000 and e["end_us"] >= e["start_us"] for e in reads)
    assert not list((tmp_path / "f" / "blobs").glob(".*tmp"))
    with pytest.raises(StoreError, match="not a lowercase hex sha256") as e:  # a path, never opened
        st.get("../../etc/passwd")
    assert e.value.code == "bad_sha"


def test_a_layout_is_made_once_kept_whole_in_flash_and_read_by_the_next_store(tmp_path):
    from edgeprobe_agent.store import FlashStore, StoreError

    def put(st, a):
        raw = a.tobytes()
        sha = hashlib.sha256(raw).hexdigest()
        assert st.put_chunk(sha, a.dtype.name, list(a.shape), len(raw), 0, 1, 1 << 20, zlib.crc32(raw), raw)
        return sha

    def listed():  # the lines the store reads (a torn one skipped)
        out = []
        for line in (layouts / "pack.jsonl").read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    wt = np.arange(-60, 60, dtype=np.int8).reshape(8, 15)  # a k-major int8[K, N] weight
    wt2 = np.arange(0, 6000, dtype=np.int64).astype(np.int8).reshape(40, 150)
    layouts = tmp_path / "f" / "layouts"
    made, reads = [], []
    st = FlashStore(tmp_path / "f", on_read=reads.append)
    sha, sha2 = put(st, wt), put(st, wt2)

    def maker(s):
        def make(out):
            made.append(s[:4])
            out[...] = st.map(s).T
        return make
    a = st.layout(sha, "rows", (15, 8), np.int8, maker(sha))
    b = st.layout(sha2, "rows", (150, 40), np.int8, maker(sha2))
    assert np.array_equal(a, wt.T) and np.array_equal(b, wt2.T) and len(made) == 2 and not reads  # made, not read
    assert st.flush_layouts(10)
    pack = (layouts / "pack").read_bytes()
    for rec, w in zip(listed(), (wt, wt2)):  # appended at page-aligned offsets, listed once whole
        assert rec["offset"] % 4096 == 0 and pack[rec["offset"]:rec["offset"] + rec["nbytes"]] == w.T.tobytes()
    assert [r["key"] for r in listed()] == [f"{sha}.rows", f"{sha2}.rows"]
    with pytest.raises(StoreError) as e:
        st.layout("0" * 64, "rows", (15, 8), np.int8, maker(sha))
    assert e.value.code == "missing_blob"
    with pytest.raises(StoreError) as e:
        st.layout(sha, "../x", (15, 8), np.int8, maker(sha))
    assert e.value.code == "bad_layout"
    st.close()
    st._lock_file.close()

    (layouts / "junk.rows.tmp").write_bytes(b"cut mid-write")
    with open(layouts / "pack", "ab") as f:  # a crash mid-append: bytes past the last listed layout, a torn line
        f.write(b"\x01" * 5000)
    with open(layouts / "pack.jsonl", "a") as f:
        f.write('{"key": "torn')
    st2 = FlashStore(tmp_path / "f", on_read=reads.append)  # the next agent process on this store
    assert not list(layouts.glob("*.tmp")) and (layouts / "pack").stat().st_size == len(pack)  # the tail cut off
    c = st2.layout(sha2, "rows", (150, 40), np.int8, maker(sha2))
    assert np.array_equal(c, wt2.T) and len(made) == 2  # read, not made again, and traced as a flash read
    assert [(r["kind"], r["layout"], r["bytes_in"]) for r in reads] == [("flash_read", "rows", wt2.nbytes)]
    c[0, 0] += 1  # mapped copy-on-write: a kernel may write its array, the pack in flash stays as made
    assert c.flags.writeable and (layouts / "pack").read_bytes() == pack
    into = np.zeros((15, 8), np.int8)
    assert st2.layout(sha, "rows", (15, 8), np.int8, maker(sha), into=into) is into and np.array_equal(into, wt.T)
    assert len(made) == 2
    # a layout listed at another size is made again and appended after the cut tail, and its new line wins
    wide = st2.layout(sha, "rows", (16, 8), np.int8, lambda out: (made.append("wide"), out.__setitem__(..., 7)))
    assert made[-1] == "wide" and np.all(wide == 7)
    assert st2.flush_layouts(10)
    assert listed()[-1]["key"] == f"{sha}.rows" and listed()[-1]["offset"] >= len(pack)
    st2.close()
    st2._lock_file.close()

    (layouts / f"{sha2}.tmp").write_bytes(b"")
    old = np.ascontiguousarray(wt.T)
    (layouts / f"{sha}.old").write_bytes(old.tobytes())  # a layout an older agent kept in a file of its own
    st3 = FlashStore(tmp_path / "f")
    assert np.array_equal(st3.layout(sha, "old", (15, 8), np.int8, maker(sha)), old) and made[-1] == "wide"
    assert np.all(st3.layout(sha, "rows", (16, 8), np.int8, maker(sha)) == 7) and made[-1] == "wide"
    assert st3.flush_layouts(10) and listed()[-1]["key"] == f"{sha}.old"  # moved into the pack for the next process
    st3.close()


def _needs_avx2():
    from edgeprobe_kernels import simd

    return pytest.mark.skipif(not simd.AVX2, reason="the agent's int8 GEMMs need numba on an AVX2 CPU; the '0' case "
                              "tests what runs without them")


@pytest.mark.parametrize("int8_gemm", [pytest.param("1", marks=_needs_avx2()), "0"])
def test_a_new_agent_reads_the_int8_layouts_an_earlier_run_kept_and_gives_the_same_bits(qm, heldout_ids, tmp_path,
                                                                                         int8_gemm, monkeypatch):
    """With int8 GEMMs (AVX2) the agent keeps row-major int8 copies and a new agent reads them; without them
    (EDGEPROBE_INT8_GEMM=0, as on a CPU without AVX2) it reads the k-major blobs and keeps no copy."""
    monkeypatch.setenv("EDGEPROBE_INT8_GEMM", int8_gemm)  # the agents inherit it
    toks = heldout_ids[:12]
    with Device.local(store=tmp_path / "flash") as dev:
        first = dev.prefill(qm, toks, progress=False)
    pack = tmp_path / "flash" / "layouts" / "pack.jsonl"
    kept = [json.loads(line)["key"] for line in (pack.read_text().splitlines() if pack.exists() else [])
            if json.loads(line)["key"].endswith(".rows")]
    with Device.local(store=tmp_path / "flash") as dev:
        again = dev.prefill(qm, toks, progress=False)
    assert np.array_equal(first.logits, again.logits)
    wts = {r["wt"] for r in qm.manifest["linears"].values() if isinstance(r, dict) and "wt" in r}
    reads = [e for e in again.trace.events if e["kind"] == "flash_read"]
    if int8_gemm == "1":  # the int8 GEMMs read the kept row-major copies, never the k-major blobs
        assert len(kept) == len(wts) and {e["blob"] for e in reads if e.get("layout") == "rows"} == wts
        assert not {e["blob"] for e in reads if not e.get("layout")} & wts
        assert not {e["blob"] for e in first.trace.events if e["kind"] == "flash_read"} & wts
    else:  # BLAS on the codes: the k-major blobs themselves, nothing kept row-major
        assert kept == [] and not [e for e in reads if e.get("layout") == "rows"]
        assert {e["blob"] for e in reads if not e.get("layout")} >= wts


def test_a_first_prefill_sends_its_three_setup_requests_together_and_mends_a_missing_blob(qm, heldout_ids, tmp_path):
    toks = heldout_ids[:8]

    def logged(dev):
        log, send, wait_any = [], dev.send, dev.wait_any
        dev.send = lambda op, *a, **k: (log.append(op), send(op, *a, **k))[1]
        dev.wait_any = lambda *a, **k: (log.append("(wait)"), wait_any(*a, **k))[1]
        return log

    with Device.local(store=tmp_path / "flash") as dev:  # a new store: every blob is missing
        log = logged(dev)
        first = dev.prefill(qm, toks, progress=False)
        stats = dev.stats()
    # has_blobs, load_model and put_plan leave before any reply is read; the two sent before the blobs were there
    # are refused (missing_blob), the blobs go up, and both are asked again
    assert log[:4] == ["has_blobs", "load_model", "put_plan", "(wait)"]
    sent = [op for op in log if op != "(wait)"]
    assert sent.count("put_blob") >= len(qm.manifest["blobs"]) and sent.count("load_model") == 2
    assert sent.count("put_plan") == 2 and sent.index("put_blob") < sent.index("load_model", 2)
    assert stats["errors"] == 2 and stats["models"] == 1
    with Device.local(store=tmp_path / "flash") as dev:  # the blobs are there: one go, nothing refused
        log = logged(dev)
        again = dev.prefill(qm, toks, progress=False)
        dev.prefill(qm, toks, progress=False)  # warm: only the run
        stats = dev.stats()
    sent = [op for op in log if op not in ("(wait)", "heartbeat")]
    assert sent[:6] == ["has_blobs", "load_model", "put_plan", "run", "run", "stats"] and stats["errors"] == 0
    assert np.array_equal(first.logits, again.logits)


def test_a_run_longer_than_the_heartbeat_timeout_completes(dev, slow_plan):
    from edgeprobe_agent.protocol import HEARTBEAT_TIMEOUT_S

    def run(n, on_progress=None):
        plan, inputs = slow_plan(n)
        pid = dev.put_plan(plan)
        t0 = time.monotonic()
        r = dev.run(pid, inputs, on_progress=on_progress)
        return r, time.monotonic() - t0
    # the long chain is sized to last twice the timeout on this machine from a short one's ops as its trace times
    # them (without the 64 MB input's transfer); each op reads the 64 MB matrix, which no cache holds, so its time
    # does not drop in a long chain (cached adds did: 50,000 of them ran in 3.5 s where 100 had taken 7 ms). The
    # difference of two short runs' wall times sized it before: beside busy processes it came out near 0, and
    # 100,000 ops' reply overflowed the protocol's 16 MB header
    run(2)
    per = statistics.median(e["end_us"] - e["start_us"] for e in run(60)[0].trace.events) / 1e6
    n = max(200, math.ceil(2 * HEARTBEAT_TIMEOUT_S / per))
    events = []
    r, took = run(n, events.append)
    assert np.array_equal(r.logits, np.ones((1, 4096), np.float32))  # x times the identity, n times
    assert any(e["event"] == "progress" for e in events)
    assert took > HEARTBEAT_TIMEOUT_S, f"the run took {took:.1f} s; make the chain longer so it tests the heartbeat"


def test_chunked_prefill_in_order_and_out_of_order_on_the_agent(dev, qm, heldout_ids):
    from edgeprobe.workflows import host_logits as _host_logits

    toks = heldout_ids[:96].astype(np.int32)
    host = _host_logits(qm, toks, 32)
    runs = {s: dev.prefill_chunked(qm, toks, chunk=32, scheduler=s, progress=False) for s in ("in-order", "ooo")}
    for s, r in runs.items():
        assert np.array_equal(r.logits[0], host), s  # the host's simulation runs the agent's kernels: the same bits
        assert {e["chunk"] for e in r.trace.events if e["lane"] != "io"} == {0, 1, 2}
        assert r.schedule.scheduler == s and r.trace.meta["predicted_makespan_ms"] > 0
    assert np.array_equal(runs["in-order"].logits, runs["ooo"].logits)  # same ops, another order
    # the agent ran each lane in the order the schedule chose
    def runs_of(seq):  # consecutive duplicates collapsed
        return [x for k, x in enumerate(seq) if k == 0 or x != seq[k - 1]]

    for s, r in runs.items():
        ran = [(e["chunk"], e["layer"]) for e in sorted(r.trace.events, key=lambda e: e["start_us"])
               if e["lane"] == "npu" and e["layer"] >= 0]
        g = r.schedule.graph.by_name()
        planned = [(g[n].chunk, g[n].layer) for n in sorted(r.schedule.slots, key=lambda n: r.schedule.slots[n][1])
                   if r.schedule.slots[n][0] == "npu"]
        assert runs_of(ran) == runs_of(planned), s
    fig, rows = runs["ooo"].trace.compare(runs["ooo"].schedule.to_trace())
    assert len(rows) == len(runs["ooo"].schedule.slots) and fig.data
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)


def test_measured_profile_real_and_predicted_modes(dev, qm, heldout_ids, tmp_path):
    from edgeprobe.schedule import ScheduleError, chunk_graph, schedule
    from edgeprobe.schedule.measure import MeasuredProfile

    # chunk lengths 4x apart: at 16 vs 32 tokens, noise from a busy CI machine once flattened the fitted slope to 0
    prof = dev.measure_profile(qm, heldout_ids, chunks=(16, 64), n_chunks=2, progress=False)
    assert set(prof.fits) >= {"npu/qkv", "npu/ffn", "cpu/attn"} and not prof.modelled
    assert all(a >= 0 and b >= 0 for a, b in prof.fits.values()) and prof.sync_us >= 0
    # two rounds over the lengths by default: every ffn subgraph of both chunks of both 64-token runs is a sample
    assert sum(s["stage"] == "ffn" and s["chunk"] == 64 for s in prof.samples) == 2 * 2 * qm.model.config.n_layers
    with pytest.raises(ScheduleError, match="at least one round"):
        dev.measure_profile(qm, heldout_ids, chunks=(16,), n_chunks=1, rounds=0, progress=False)
    g = chunk_graph(qm.model.config, 128, 64, shadow=prof.meta["shadow_layers"])
    real = prof.with_mode("real")
    s0 = next(s for s in prof.samples if s["stage"] == "ffn" and s["chunk"] == 64)
    sub = next(x for x in g.subgraphs if x.stage == "ffn" and x.tokens == s0["tokens"])
    same = [s["us"] for s in prof.samples if s["stage"] == "ffn" and s["tokens"] == s0["tokens"]]
    assert real.time_us(sub) == pytest.approx(float(np.median(same)))  # real mode: the measured median
    a, b = prof.fits["npu/ffn"]
    assert prof.time_us(sub) == pytest.approx(a + b * sub.flops)  # predicted mode: the fit, for any shape
    big = chunk_graph(qm.model.config, 512, 128, shadow=prof.meta["shadow_layers"])
    assert prof.time_us(big.subgraphs[-1]) > prof.time_us(sub)  # a larger chunk is predicted slower
    err = prof.fit_error()  # leave one chunk length out: every sample of a stage is predicted once
    assert set(err) == {*prof.fits, "all"} and all(
        err[k]["n"] == sum(f"{s['lane']}/{s['stage']}" == k for s in prof.samples) for k in prof.fits)
    # its arithmetic: times on a line are predicted exactly; a chunk length 1.5x slow is off by 1/3 when held out
    line = [{"lane": "npu", "stage": "ffn", "tokens": c, "kv_len": 0, "chunk": c, "flops": 1e6 * c,
             "us": 7.0 + 3.0 * c} for c in (16, 32, 64, 128) for _ in range(2)]
    assert MeasuredProfile(line).fit_error()["npu/ffn"]["max"] == pytest.approx(0, abs=1e-9)
    slow = [{**s, "us": s["us"] * (1.5 if s["chunk"] == 128 else 1)} for s in line]
    assert MeasuredProfile(slow).fit_error()["npu/ffn"]["max"] >= 1 / 3 - 1e-9
    sched = schedule(g, prof, "ooo")
    sched.check()
    assert not sched.to_trace().meta["modelled"]
    back = MeasuredProfile.from_json(prof.to_json(tmp_path / "p.json"))
    assert back.time_us(sub) == pytest.approx(prof.time_us(sub)) and back.meta == prof.meta
    (tmp_path / "bad.json").write_text("{\"kind\": \"something else\"}")
    with pytest.raises(ScheduleError, match="not an edgeprobe measured profile"):
        MeasuredProfile.from_json(tmp_path / "bad.json")
    with pytest.raises(ScheduleError, match="no samples of stage"):
        prof.time_us(sub, lane="gpu")
    res = dev.prefill_chunked(qm, heldout_ids[:64], 32, "ooo", profile=prof, progress=False)
    assert res.schedule.profile is prof and res.trace.metrics()["makespan_ms"] > 0


def test_hetero_partitions_run_on_gpu_and_npu_lanes_with_identical_results(dev, qm, heldout_ids):
    from edgeprobe.schedule import STRATEGIES, ScheduleError, choices_for

    hp, samples = dev.measure_linears(qm, rows=(32, 64), progress=False)
    assert hp.npu_gops > 0 and hp.gpu_gflops > 0 and not hp.modelled and hp.slowdown_npu >= 1
    assert {s["lane"] for s in samples} == {"npu", "gpu"} and all(s["us"] > 0 for s in samples)
    toks = heldout_ids[:45]  # unaligned: the NPU pads to 64, or runs 32 and leaves 13 rows to the GPU
    res = {s: dev.prefill_hetero(qm, toks, hp, s, progress=False) for s in STRATEGIES}
    for s, r in res.items():
        assert np.array_equal(r.logits, res["npu-pad"].logits), s  # every int8 GEMM is exact: cuts change nothing
    ev = res["row-cut"].trace.events
    npu = [e for e in ev if e["kind"] == "linear" and e["lane"] == "npu" and "attn_q" in e["name"]]
    gpu = [e for e in ev if e["kind"] == "linear" and e["lane"] == "gpu" and "attn_q" in e["name"]]
    assert npu and gpu and npu[0]["shape"][0] == 45  # padded rows are computed then dropped
    assert npu[0]["flops"] == 2 * 64 * 576 * npu[0]["shape"][1] and npu[0]["shape"][1] % 64 == 0
    assert gpu[0]["shape"][1] == 576 - npu[0]["shape"][1]
    seq = [e for e in res["seq-cut"].trace.events
           if e["kind"] == "linear" and e["lane"] != "cpu" and "attn_q" in e["name"]]
    assert sorted(e["shape"][0] for e in seq if e["layer"] == 0) == [13, 32]
    assert set(res["gpu"].trace.metrics()["lanes"]) >= {"gpu"} and "npu" not in res["gpu"].trace.metrics()["lanes"]
    assert choices_for(qm.model.config, 45, hp, "pipe")["attn_q"].npu_parts == (32, 32)
    with pytest.raises(ScheduleError, match="unknown partition strategy"):
        choices_for(qm.model.config, 45, hp, "diagonal")


def test_plans_for_lanes_the_agent_lacks_fail_clearly(tmp_path):
    from edgeprobe.device import Device

    env = {**os.environ, "EDGEPROBE_AGENT_STORE": str(tmp_path / "st")}
    with Device.local(store=tmp_path / "st", lanes=["cpu", "npu"]) as d:
        assert d.info["lanes"] == ["cpu", "npu"]
        url = d.url
        for sched in ("hetero",):
            r = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--prompt-len", "16", "--device", url,
                                "--scheduler", sched, "--no-progress"],
                               capture_output=True, text=True, timeout=900, env=env)
            assert r.returncode == 2 and "lacks" in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]
    with Device.local(store=tmp_path / "st", lanes=["cpu"]) as d:
        r = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--prompt-len", "16", "--chunk", "8", "--device",
                            d.url, "--scheduler", "ooo", "--no-progress"],
                           capture_output=True, text=True, timeout=900, env=env)
        assert (r.returncode == 2 and "lacks" in r.stderr and "npu" in r.stderr
                and "Traceback" not in r.stderr), r.stderr[-1500:]
    bad = subprocess.run([sys.executable, "-m", "edgeprobe_agent", "--bind", "tcp://127.0.0.1:*", "--store",
                          str(tmp_path / "st"), "--lanes", "cpu,tpu"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "lanes must be some of" in bad.stderr


def test_a_killed_host_leaves_no_agent_holding_the_store(tmp_path, exited):
    """kill -9 of the host process (an interrupted demo, a crashed kernel): its local agent notices and stops,
    so the next Device.local on the same store gets it at once instead of waiting on a stale lock."""
    import signal
    import subprocess
    import sys

    from edgeprobe.local_agent import store_held

    store = tmp_path / "s"
    with subprocess.Popen([sys.executable, "-c", (
            "import sys, time\nfrom edgeprobe import Device\n"
            f"d = Device.local(store={str(store)!r})\nprint(d.process.pid, flush=True)\ntime.sleep(600)")],
            stdout=subprocess.PIPE, text=True) as child:  # on the way out: its pipe closed, the process waited
        try:
            agent_pid = int(child.stdout.readline())
            assert store_held(store)  # the agent is up, holding the store
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
            assert exited(agent_pid) in ("Z", "gone"), "the orphaned agent kept running after its host was killed"
            # the store's lock is free (state, not a time): the next agent takes it at once, no store_busy
            assert not store_held(store)
            with Device.local(store=store) as dev:
                assert dev.hello()["store"] is not None
        finally:
            child.kill()
