"""Issue 20: every request gets exactly one final reply under its own id, on every path where one could be lost —
a failing or cancelled run, a worker that cannot start or dies, a reply that cannot be packed, put_blob's deferred
replies, a client that leaves mid-upload or mid-run, an agent told to stop with runs in flight."""
import hashlib
import threading
import time
import zlib

import numpy as np
import pytest
import zmq

from edgeprobe.device import Device, DeviceError
from edgeprobe_agent.protocol import HEARTBEAT_TIMEOUT_S, PROTOCOL_VERSION, pack, unpack


@pytest.fixture(scope="module")
def toy(tiny):
    return tiny(2, seed=7)


def _length(dev, name):
    return dev.request("session_reorder", session=name, indices=[0])[0]["length"]


def _send_run(d, plan_id, inputs, **fields):
    return d.send("run", list(inputs.values()), plan_id=plan_id, inputs=list(inputs), **fields)


def test_a_failed_or_cancelled_step_answers_under_its_id_and_leaves_the_session_as_it_was(dev, toy, slow_plan):
    with dev.session(toy, 16, name="fail", progress=False) as s:
        s.prefill([1, 2, 3])
        step = s._plan(1, 1)
        rid = dev.send("run", [np.array([9999], np.int32)], plan_id=step, inputs=["tokens"], session="fail", advance=1,
                       phase="decode")
        with pytest.raises(DeviceError, match="token ids outside") as e:
            dev.wait(rid)
        assert e.value.code == "bad_input" and _length(dev, "fail") == 3  # not moved on, not busy
        plan, inputs = slow_plan(4000)
        rid = _send_run(dev, dev.put_plan(plan), inputs, session="fail", advance=1)
        time.sleep(0.2)
        busy = dev.send("run", [np.array([1], np.int32)], plan_id=step, inputs=["tokens"], session="fail", advance=1,
                        phase="decode")
        with pytest.raises(DeviceError, match="in flight") as e:
            dev.wait(busy)
        assert e.value.code == "busy"
        dup = dev.send("cancel", target=rid)
        assert dev.wait(dup)[0]["cancelled"] == rid
        with pytest.raises(DeviceError, match="cancelled") as e:
            dev.wait(rid)
        assert e.value.code == "cancelled"
        s.step([1])  # at once: the cancelled run left the registry before its reply
        assert _length(dev, "fail") == 4
        with pytest.raises(DeviceError, match="no run with id") as e:
            dev.request("cancel", target=rid)  # finished runs cannot be cancelled twice
        assert e.value.code == "unknown_target"


def test_a_decode_loop_on_the_agent_cancelled_or_refused_leaves_the_session_as_it_was(dev, toy):
    def host_steps(s, tok, n):  # n steps, each token sampled on the host: the reference bits
        out = []
        for _ in range(n):
            out.append(s.step([tok]))
            tok = int(out[-1][0].argmax())
        return out

    with dev.session(toy, 4000, name="ref", progress=False) as s:
        s.prefill([1, 2, 3])
        ref = host_steps(s, 5, 3)
    with dev.session(toy, 4000, name="loop", progress=False) as s:
        s.prefill([1, 2, 3])
        step = s._plan(1, 1)
        progress = []
        rid = dev.send("run", [np.array([5], np.int32)], plan_id=step, inputs=["tokens"], session="loop", advance=1,
                       phase="decode", steps=3990)
        deadline = time.monotonic() + 30
        while not progress and time.monotonic() < deadline:
            if dev.sock.poll(100):
                h, _ = unpack(dev.sock.recv_multipart())
                if h.get("event") == "progress":
                    progress.append(h)
        # the loop reports progress over all its steps' ops while it runs; cancel it once it has
        assert progress and progress[0]["total"] % 3990 == 0 and 0 < progress[0]["done"] < progress[0]["total"]
        assert dev.request("cancel", target=rid)[0]["cancelled"] == rid
        with pytest.raises(DeviceError, match="cancelled"):
            dev.wait(rid)
        assert _length(dev, "loop") == 3  # the positions the loop wrote are not the sequence's
        for fields, code in (({"steps": 0}, "bad_request"), ({"steps": 2, "keep": "some"}, "bad_request"),
                             ({"steps": 2, "phase": "prefill"}, "bad_request"), ({"steps": 3998}, "context_full")):
            rid = dev.send("run", [np.array([5], np.int32)], plan_id=step, inputs=["tokens"], session="loop",
                           advance=1, **{"phase": "decode", **fields})
            with pytest.raises(DeviceError) as e:
                dev.wait(rid)
            assert e.value.code == code, fields
        rid = dev.send("run", [np.array([5], np.int32)], plan_id=step, inputs=["tokens"], steps=2)
        with pytest.raises(DeviceError, match="greedy decode loop") as e:
            dev.wait(rid)  # no session
        assert _length(dev, "loop") == 3
        got = host_steps(s, 5, 3)
    assert all((a == b).all() for a, b in zip(got, ref))


def test_a_request_id_already_running_is_refused_and_the_run_still_answers_once(dev, slow_plan):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(dev.url)
    plan, inputs = slow_plan(4000)
    head = {"v": PROTOCOL_VERSION, "op": "run", "plan_id": dev.put_plan(plan), "inputs": list(inputs)}
    x = list(inputs.values())
    sock.send_multipart(pack({**head, "id": 5}, x))
    sock.send_multipart(pack({**head, "id": 5}, x))
    sock.send_multipart(pack({"v": PROTOCOL_VERSION, "op": "cancel", "id": 6, "target": 5}))
    finals = []
    deadline = time.monotonic() + 20
    while len(finals) < 3 and time.monotonic() < deadline:
        if sock.poll(200):
            h, _ = unpack(sock.recv_multipart())
            if h["final"]:
                finals.append((h["id"], h["ok"], h.get("error", {}).get("code")))
    assert not sock.poll(300)
    assert sorted(finals, key=str) == sorted([(5, False, "bad_id"), (6, True, None), (5, False, "cancelled")], key=str)
    sock.close(0)


def test_a_big_plan_is_validated_off_the_loop_which_keeps_answering(dev):
    socks = []
    for _ in range(2):
        s_ = zmq.Context.instance().socket(zmq.DEALER)
        s_.setsockopt(zmq.LINGER, 0)
        s_.connect(dev.url)
        socks.append(s_)
    big = {"ops": [{"name": f"a{i}", "kind": "add", "lane": "cpu",
                    "inputs": [{"input": "x"} if i == 0 else {"op": f"a{i - 1}"}, {"input": "x"}]}
                   for i in range(50_000)]}
    socks[0].send_multipart(pack({"v": PROTOCOL_VERSION, "id": 1, "op": "put_plan", "plan": big}))
    time.sleep(0.05)
    socks[1].send_multipart(pack({"v": PROTOCOL_VERSION, "id": 2, "op": "heartbeat"}))
    poller = zmq.Poller()
    for s_ in socks:
        poller.register(s_, zmq.POLLIN)
    order = []
    deadline = time.monotonic() + 60
    while len(order) < 2 and time.monotonic() < deadline:
        for s_, _ in poller.poll(200):
            h, _ = unpack(s_.recv_multipart())
            order.append((h["id"], h["ok"]))
    assert order == [(2, True), (1, True)]  # the heartbeat did not wait for 50,000 ops to be checked
    for s_ in socks:
        s_.close(0)


def test_put_blob_replies_from_the_store_thread_carry_their_ids(dev):
    raw = np.arange(3000, dtype=np.float32).tobytes()
    wrong = hashlib.sha256(b"not these bytes").hexdigest()
    cb = 4096
    n = -(-len(raw) // cb)
    replies = []
    for i in range(n):
        piece = np.frombuffer(raw[i * cb:(i + 1) * cb], np.uint8)
        rid = dev.send("put_blob", [piece], sha=wrong, dtype="float32", shape=[3000], nbytes=len(raw), chunk=i,
                       n_chunks=n, chunk_bytes=cb, chunk_crc32=zlib.crc32(piece))
        try:
            replies.append((rid, dev.wait(rid)[0]["complete"]))
        except DeviceError as e:
            replies.append((rid, e.code))
    assert [r for _, r in replies] == [False, False, "blob_checksum"]  # the last one's reply came from the hash thread
    h = dev.request("has_blobs", ids=[wrong])[0]
    assert h["have"] == [] and h["partial"] == {}  # nothing under the wrong name, no partial left


def test_the_store_threads_survive_failures_and_still_answer(tmp_path, monkeypatch):
    import edgeprobe_agent.store as store_mod

    st = store_mod.FlashStore(tmp_path / "f")
    raw = np.arange(100, dtype=np.float32).tobytes()
    sha = hashlib.sha256(raw).hexdigest()
    put = lambda: st.put_chunk(sha, "float32", [100], len(raw), 0, 1, 1 << 20, zlib.crc32(raw), raw)

    def broken(*a, **k):
        raise RuntimeError("disk on fire")
    with monkeypatch.context() as m:
        m.setattr(store_mod.os, "pwrite", broken)  # fails on the writer thread
        with pytest.raises(store_mod.StoreError, match="disk on fire") as e:
            put()
        assert e.value.code == "write_failed"
    with monkeypatch.context() as m:
        m.setattr(store_mod.os, "fsync", broken)  # fails on the commit's fsync threads, finishing the blob
        with pytest.raises(store_mod.StoreError, match="disk on fire") as e:
            put()
        assert e.value.code == "internal"
        assert not st.has(sha)  # never visible without its fsync
    assert put() is True  # both threads lived on
    assert np.array_equal(st.get(sha), np.frombuffer(raw, np.float32))


def test_a_client_that_leaves_mid_upload_or_mid_run_leaves_nothing_stuck(dev, toy, slow_plan):
    raw = np.random.default_rng(1).standard_normal(3000).astype(np.float32).tobytes()
    sha = hashlib.sha256(raw).hexdigest()
    cb = 4096
    n = -(-len(raw) // cb)
    gone = zmq.Context.instance().socket(zmq.DEALER)
    gone.setsockopt(zmq.LINGER, 1000)
    gone.connect(dev.url)
    for i in range(2):  # two chunks of three, replies never read
        piece = np.frombuffer(raw[i * cb:(i + 1) * cb], np.uint8)
        gone.send_multipart(pack({"v": PROTOCOL_VERSION, "id": 100 + i, "op": "put_blob", "sha": sha,
                                  "dtype": "float32", "shape": [3000], "nbytes": len(raw), "chunk": i, "n_chunks": n,
                                  "chunk_bytes": cb, "chunk_crc32": zlib.crc32(piece)}, [piece]))
    with dev.session(toy, 8, name="left", progress=False) as s:  # and a run in a session, abandoned too
        s.prefill([1, 2])
        plan, inputs = slow_plan(8000)  # 20 s on an idle core: far longer than the heartbeat timeout
        gone.send_multipart(pack({"v": PROTOCOL_VERSION, "id": 102, "op": "run", "plan_id": dev.put_plan(plan),
                                  "inputs": list(inputs), "session": "left", "advance": 1}, list(inputs.values())))
        gone.close()
        deadline = time.monotonic() + 5
        while dev.request("has_blobs", ids=[sha])[0]["partial"].get(sha) != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dev.request("has_blobs", ids=[sha])[0]["partial"][sha] == [0, 1]

        class OneBlob:
            manifest = {"blobs": {sha: {"nbytes": len(raw)}}}

            class store:
                get = staticmethod(lambda s_: np.frombuffer(raw, np.float32))
        assert dev.upload(OneBlob, progress=False, chunk_bytes=cb) == len(raw) - 2 * cb  # the missing chunk only
        t0 = time.monotonic()
        while not dev.stats()["runs_in_flight"] and time.monotonic() - t0 < 10:
            time.sleep(0.05)  # its 64 MB input may still be arriving
        assert dev.stats()["runs_in_flight"] == 1
        t0 = time.monotonic()
        while dev.stats()["runs_in_flight"] and time.monotonic() - t0 < HEARTBEAT_TIMEOUT_S + 10:
            time.sleep(0.2)
        assert dev.stats()["runs_in_flight"] == 0  # cancelled once the client was silent for the timeout
        assert time.monotonic() - t0 < HEARTBEAT_TIMEOUT_S + 10
        s.step([1])  # the session is free and was not moved on by the cancelled run
        assert _length(dev, "left") == 3


def test_a_stopping_agent_ends_runs_in_flight_with_cancelled_under_their_ids(tmp_path, slow_plan):
    owner = Device.local(store=tmp_path / "st")
    other = Device.connect(owner.url)
    try:
        plan, inputs = slow_plan(4000)
        rid = _send_run(other, other.put_plan(plan), inputs)
        time.sleep(0.3)
        owner.close()  # bye with shutdown
        with pytest.raises(DeviceError, match="cancelled") as e:
            other.wait(rid)
        assert e.value.code == "cancelled"
    finally:
        other.sock.close(0)
        owner.close()


# ---- paths a message cannot reach: an agent in this process, with faults injected --------------------------

@pytest.fixture
def inproc(tmp_path):
    from edgeprobe_agent.server import Agent

    agent = Agent("tcp://127.0.0.1:*", tmp_path / "st", lanes=["cpu", "npu"])
    loop = threading.Thread(target=agent.serve_forever, daemon=True, name="agent-loop")
    loop.start()
    d = Device.connect(agent.url)
    yield agent, d
    d.close(shutdown=True)
    loop.join(timeout=10)
    assert not loop.is_alive()


def test_worker_faults_still_end_in_one_reply_under_the_run_id(inproc, monkeypatch):
    import edgeprobe_agent.server as server
    from edgeprobe_agent.ops import OPS

    agent, d = inproc
    monkeypatch.setitem(OPS, "fault_object", lambda inp, attrs, ctx: np.array([object()]))  # cannot go on the wire
    monkeypatch.setitem(OPS, "fault_exit", lambda inp, attrs, ctx: (_ for _ in ()).throw(SystemExit(3)))
    x = {"x": np.ones(2, np.float32)}
    for kind, code, text in (("fault_object", "internal", "could not be packed"),
                             ("fault_exit", "internal", "SystemExit")):
        pid = d.put_plan({"ops": [{"name": "f", "kind": kind, "lane": "cpu", "inputs": [{"input": "x"}]}]})
        rid = d.send("run", [x["x"]], plan_id=pid, inputs=["x"])
        with pytest.raises(DeviceError, match=text) as e:
            d.wait(rid)
        assert e.value.code == code
    real_thread = threading.Thread

    class NoRunThreads(real_thread):
        def start(self):
            if self.name == "agent-worker":
                raise RuntimeError("can't start new thread")
            return super().start()
    ok = d.put_plan({"ops": [{"name": "a", "kind": "add", "lane": "cpu", "inputs": [{"input": "x"}, {"input": "x"}]}]})
    monkeypatch.setattr(server.threading, "Thread", NoRunThreads)
    agent.workers = server._Workers()  # no idle worker: the run needs a new thread, which cannot start
    with pytest.raises(DeviceError, match="can't start new thread") as e:
        d.run(ok, x)
    assert e.value.code == "internal"
    monkeypatch.setattr(server.threading, "Thread", real_thread)
    assert d.stats()["runs_in_flight"] == 0 and agent.runs == {}  # nothing left behind in the registry
    assert np.array_equal(d.run(ok, x).logits, 2 * x["x"])
