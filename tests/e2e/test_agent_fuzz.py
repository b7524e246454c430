"""Ten thousand malformed messages at a real agent: each gets exactly one final reply, under the request's own id
whenever the header carries an integer id, and the agent counts every one and keeps serving."""
import time
from collections import Counter

import msgpack
import numpy as np
import pytest
import zmq

from edgeprobe.device import DeviceError
from edgeprobe_agent.protocol import HEARTBEAT_TIMEOUT_S, NO_ID, PROTOCOL_VERSION, pack, unpack

N = 10_000
BATCH = 500  # below the ROUTER's send high-water mark (1000): the agent never has to drop a reply


def _raw(dev):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(dev.url)
    return s


def _h(rid, **kw):
    return {"v": PROTOCOL_VERSION, "id": rid, "op": "hello", **kw}


def _spec(rid, spec, *payload):
    return [msgpack.packb(_h(rid, frames=spec))] + list(payload)


SHA = "ab" * 32
# kind -> (message for id rid, whether the agent can read the id). Every kind of malformed frame description comes
# with a readable integer id; so do bad versions, ops and fields. Only the last few hide the id.
KINDS = {
    "dtype outside the list": lambda r, g: _spec(r, [{"dtype": g.choice(["object", "complex64", "<f4", "U8", "V3"]),
                                                      "shape": [2]}], b"x" * 16),
    "dtype not a string": lambda r, g: _spec(r, [{"dtype": [1, 2], "shape": [1]}], b"x"),
    "negative dimension": lambda r, g: _spec(r, [{"dtype": "float32", "shape": [int(g.integers(-9, 0)), 4]}], b""),
    "enormous shape": lambda r, g: _spec(r, [{"dtype": "int64", "shape": [2 ** 62, 4]}], b""),
    "shape past 2**64": lambda r, g: _spec(r, [{"dtype": "uint8", "shape": [2 ** 64 - 1, 2]}], b""),
    "too many dimensions": lambda r, g: _spec(r, [{"dtype": "uint8", "shape": [1] * 40}], b"x"),
    "bool dimension": lambda r, g: _spec(r, [{"dtype": "uint8", "shape": [True, 1]}], b"x"),
    "shape not a list": lambda r, g: _spec(r, [{"dtype": "uint8", "shape": g.choice(["4", 4, None])}], b"xxxx"),
    "spec not a map": lambda r, g: _spec(r, ["uint8"], b"x"),
    "frames not a list": lambda r, g: _spec(r, {"dtype": "uint8", "shape": [1]}, b"x"),
    "more frames than described": lambda r, g: _spec(r, [{"dtype": "uint8", "shape": [1]}], b"x", b"y"),
    "fewer frames than described": lambda r, g: _spec(r, [{"dtype": "uint8", "shape": [1]}] * 2, b"x"),
    "frames with no description": lambda r, g: [msgpack.packb(_h(r)), b"abc"],
    "byte count": lambda r, g: _spec(r, [{"dtype": "float32", "shape": [4]}], g.bytes(int(g.integers(0, 15)))),
    "version": lambda r, g: [msgpack.packb(_h(r, v=int(g.integers(2, 99))))],
    "unknown op": lambda r, g: [msgpack.packb(_h(r, op=g.bytes(6).hex()))],
    "op not a string": lambda r, g: [msgpack.packb(_h(r, op=["run"]))],
    "put_blob fields": lambda r, g: [msgpack.packb(_h(r, op="put_blob", sha=SHA))],
    "put_blob dtype": lambda r, g: pack(_h(r, op="put_blob", sha=SHA, dtype="object", shape=[1], nbytes=1, chunk=0,
                                           n_chunks=1, chunk_bytes=1, chunk_crc32=0), [np.zeros(1, np.uint8)]),
    "put_blob huge shape": lambda r, g: pack(_h(r, op="put_blob", sha=SHA, dtype="uint8", shape=[2 ** 62, 4], nbytes=0,
                                                chunk=0, n_chunks=1, chunk_bytes=1, chunk_crc32=0),
                                             [np.zeros(0, np.uint8)]),
    "bad sha": lambda r, g: [msgpack.packb(_h(r, op="has_blobs", ids=[g.bytes(4).hex()]))],
    "plan": lambda r, g: [msgpack.packb(_h(r, op="put_plan", plan={"ops": [{"name": "a", "kind": "nope"}]}))],
    "run of no plan": lambda r, g: [msgpack.packb(_h(r, op="run", plan_id=g.choice(["missing", None])))],
    "run plan_id a list": lambda r, g: [msgpack.packb(_h(r, op="run", plan_id=["x"]))],
    "cancel target a list": lambda r, g: [msgpack.packb(_h(r, op="cancel", target=[1]))],
    "unknown session": lambda r, g: [msgpack.packb(_h(r, op="session_reorder", session="nope", indices=[0]))],
    "model_id a map": lambda r, g: [msgpack.packb(_h(r, op="open_session", model_id={"a": 1}, session="s", batch=1,
                                                     capacity=1))],
    # the id cannot be read: answered under -1
    "not msgpack": lambda r, g: [b"\xc1" + g.bytes(int(g.integers(0, 100)))],
    "not a map": lambda r, g: [msgpack.packb([r, "hello"])],
    "id not an integer": lambda r, g: [msgpack.packb(_h(g.choice([str(r), float(r), None, True])))],
    "no id and bad frames": lambda r, g: [msgpack.packb({"v": 1, "op": "hello", "frames": [{"dtype": "x"}]}), b"x"],
    "empty header": lambda r, g: [b""],
}
HIDDEN = {"not msgpack", "not a map", "id not an integer", "no id and bad frames", "empty header"}


def test_ten_thousand_malformed_messages_each_get_one_reply_under_their_id(dev):
    rng = np.random.default_rng(20)
    sock = _raw(dev)
    before, _ = (lambda f: unpack(f))(_ask(sock, pack(_h(1, op="stats"))))
    names = list(KINDS)
    finals, hidden_sent, hidden_got, wrong = Counter(), 0, 0, []
    t0 = time.perf_counter()
    for start in range(0, N, BATCH):
        sent = {}
        for k in range(start, start + BATCH):
            kind = names[k % len(names)]
            rid = 1000 + k
            sock.send_multipart(KINDS[kind](rid, rng))
            sent[rid] = kind
            hidden_sent += kind in HIDDEN
        got = 0
        while got < BATCH:
            assert sock.poll(10_000), f"the agent stopped answering after {start + got} messages"
            h, _ = unpack(sock.recv_multipart())
            assert h["final"] and h["ok"] is False and h["error"]["code"] and h["error"]["message"], h
            got += 1
            if h["id"] == NO_ID:
                hidden_got += 1
            else:
                finals[h["id"]] += 1
                if sent.get(h["id"]) in HIDDEN or h["id"] not in sent:
                    wrong.append(h)
    took = time.perf_counter() - t0
    assert not sock.poll(300), "a reply more than the requests sent"
    assert not wrong, wrong[:3]
    readable = [1000 + k for k in range(N) if names[k % len(names)] not in HIDDEN]
    assert set(finals) == set(readable) and all(n == 1 for n in finals.values())  # one reply each, under its id
    assert hidden_got == hidden_sent
    h, _ = unpack(_ask(sock, pack(_h(2))))
    assert h["ok"] and h["id"] == 2 and h["protocol"] == PROTOCOL_VERSION
    after, _ = unpack(_ask(sock, pack(_h(3, op="stats"))))
    assert after["errors"] - before["errors"] == N  # every one counted as an error
    assert after["served"] - before["served"] == 2   # the first stats and the hello
    print(f"\nfuzz: {N} malformed messages of {len(KINDS)} kinds ({len(KINDS) - len(HIDDEN)} with a readable id) in "
          f"{took:.1f} s ({N / took:.0f}/s); {len(readable)} answered under their own id, {hidden_got} under -1; agent "
          f"counted served +{after['served'] - before['served']}, errors +{after['errors'] - before['errors']}")
    sock.close(0)


def _ask(sock, frames, timeout_ms=5000):
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "the agent did not answer"
    return sock.recv_multipart()


@pytest.mark.parametrize("spec, payload", [([{"dtype": "object", "shape": [1]}], [b"x" * 8]),
                                           ([{"dtype": "float32", "shape": [2 ** 62, 4]}], [b""]),
                                           ([{"dtype": "float32", "shape": [4]}], [b"abc"])])
def test_the_client_raises_a_bad_frame_error_at_once(dev, spec, payload):
    rid = next(dev._ids)
    dev.sock.send_multipart(_spec(rid, spec, *payload))
    t0 = time.monotonic()
    with pytest.raises(DeviceError) as e:
        dev.wait(rid)
    # not after a heartbeat timeout (a 1 s bound read a busy machine's scheduling, not the client)
    assert e.value.code == "bad_frames" and time.monotonic() - t0 < HEARTBEAT_TIMEOUT_S


def test_a_reply_under_id_minus_one_is_raised_at_once_not_waited_out(dev):
    dev.sock.send_multipart([b"\xc1 not msgpack"])
    t0 = time.monotonic()
    with pytest.raises(DeviceError, match="could not read the id") as e:
        dev.hello()
    assert e.value.code == "bad_header" and time.monotonic() - t0 < HEARTBEAT_TIMEOUT_S
    assert dev.hello()["protocol"] == PROTOCOL_VERSION  # the hello's own reply was skipped as stale
