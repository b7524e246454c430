"""The blob store's durable write path: no blob under its name before its bytes and index line are fsynced and
its sha256 verified, no "complete" reply before its name is durable, and a killed agent leaves only whole blobs and
resumable partials."""
import hashlib
import json
import os
import signal
import threading
import time
import zlib

import numpy as np

from edgeprobe.device import Device


def _blob(i: int, n: int) -> tuple[str, bytes]:
    raw = np.random.default_rng(i).standard_normal(n).astype(np.float32).tobytes()
    return hashlib.sha256(raw).hexdigest(), raw


def test_a_blob_is_fsynced_verified_and_renamed_before_its_complete_reply(tmp_path, monkeypatch):
    import edgeprobe_agent.store as store_mod

    log, lock = [], threading.Lock()
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        real_fsync(fd)
        with lock:
            log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def replace(a, b):
        real_replace(a, b)
        with lock:
            log.append(("replace", str(a), str(b)))
    monkeypatch.setattr(store_mod.os, "fsync", fsync)
    monkeypatch.setattr(store_mod.os, "replace", replace)
    st = store_mod.FlashStore(tmp_path / "f")
    blobs = [_blob(i, 3000 + 1000 * i) for i in range(12)]  # 12-48 kB, 1-3 chunks of 16 kB
    cb = 16 * 1024
    done = threading.Semaphore(0)
    replies = []

    def on_done(sha):
        def cb_(result):
            with lock:  # what the reply would report must already be true when it is sent
                replies.append((sha, result, st.has(sha), len(log)))
            done.release()
        return cb_
    for sha, raw in blobs:
        n = -(-len(raw) // cb)
        for i in range(n):
            piece = raw[i * cb:(i + 1) * cb]
            st.put_chunk(sha, "float32", [len(raw) // 4], len(raw), i, n, cb, zlib.crc32(piece), piece, on_done(sha))
        # the last chunk once more while it is being finished: answered with the blob, not before
        st.put_chunk(sha, "float32", [len(raw) // 4], len(raw), n - 1, n, cb, zlib.crc32(raw[(n - 1) * cb:]),
                     raw[(n - 1) * cb:], on_done(sha))
    total = sum(-(-len(raw) // cb) + 1 for _, raw in blobs)
    for _ in range(total):
        assert done.acquire(timeout=30)
    blob_dir = str(tmp_path / "f" / "blobs")
    for sha, raw in blobs:
        finals = [r for r in replies if r[0] == sha and r[1] is True]
        assert len(finals) >= 2 and all(visible for _, _, visible, _ in finals)
        first_reply = min(at for _, _, _, at in finals)
        events = log[:first_reply]
        rename = next(k for k, e in enumerate(events) if e[0] == "replace" and e[2] == f"{blob_dir}/{sha}")
        part = f"{tmp_path / 'f' / 'partial' / sha}.part"
        assert any(e == ("fsync", part) for e in events[:rename])  # the bytes are on flash before the name
        assert ("fsync", f"{blob_dir}/index.jsonl") in events[:rename]  # its dtype/shape are on flash before its name
        assert any(e == ("fsync", blob_dir) for e in events[rename:])  # the name is durable before the reply
        assert open(f"{blob_dir}/{sha}", "rb").read() == raw
    # a group commit: fewer folder fsyncs than blobs is allowed, more than one per blob is not
    assert 1 <= sum(e == ("fsync", blob_dir) for e in log) <= len(blobs)
    st.close()


def test_a_killed_agent_leaves_only_whole_blobs_and_the_next_one_resumes(tmp_path):
    blobs = dict(_blob(100 + i, 40_000 + 7_000 * i) for i in range(16))  # 160-580 kB, up to 5 chunks of 128 kB

    class Model:  # the smallest QuantizedModel-like object upload() needs
        manifest = {"blobs": {s: {"nbytes": len(r)} for s, r in blobs.items()}}

        class store:
            get = staticmethod(lambda s: np.frombuffer(blobs[s], np.float32))
    store = tmp_path / "s"
    dev = Device.local(store=store)
    cb = 128 * 1024
    sent_before = []
    for sha, raw in list(blobs.items())[:10]:  # the chunks go out unanswered, then the agent is killed mid-stream
        n = -(-len(raw) // cb)
        for i in range(n):
            piece = np.frombuffer(raw[i * cb:(i + 1) * cb], np.uint8)
            sent_before.append(dev.send("put_blob", [piece], sha=sha, dtype="float32", shape=[len(raw) // 4],
                                        nbytes=len(raw), chunk=i, n_chunks=n, chunk_bytes=cb,
                                        chunk_crc32=zlib.crc32(piece)))
    dev.wait(sent_before[len(sent_before) // 2])
    proc, dev.process = dev.process, None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    dev.sock.close(0)
    visible = [p.name for p in (store / "blobs").iterdir() if len(p.name) == 64]
    indexed = {json.loads(line)["sha"] for line in (store / "blobs" / "index.jsonl").read_text().splitlines()}
    for sha in visible:  # whatever made it under its name is whole and has its dtype/shape in the index
        assert (store / "blobs" / sha).read_bytes() == blobs[sha] and sha in indexed
    t0 = time.monotonic()
    with Device.local(store=store) as again:  # a new agent on the same flash
        head = again.request("has_blobs", ids=list(blobs))[0]
        assert set(head["have"]) == set(visible)
        sent = again.upload(Model, progress=False, chunk_bytes=cb)
        missing = sum(len(raw[i * cb:(i + 1) * cb]) for s, raw in blobs.items() if s not in visible
                      for i in range(-(-len(raw) // cb)) if i not in head["partial"].get(s, []))
        assert sent == missing  # the chunks a killed agent had written are not sent again
        assert set(again.request("has_blobs", ids=list(blobs))[0]["have"]) == set(blobs)
    for sha, raw in blobs.items():
        assert (store / "blobs" / sha).read_bytes() == raw
    assert not list((store / "partial").glob("*.part"))
    assert time.monotonic() - t0 < 60


def test_the_index_survives_a_torn_line_and_old_sidecars_still_read(tmp_path):
    from edgeprobe_agent.store import FlashStore

    (sha_a, raw_a), (sha_b, raw_b), (sha_c, raw_c) = _blob(200, 500), _blob(201, 700), _blob(202, 300)
    st = FlashStore(tmp_path / "f", lock_wait_s=0)
    for sha, raw in ((sha_a, raw_a), (sha_b, raw_b)):
        assert st.put_chunk(sha, "float32", [len(raw) // 4], len(raw), 0, 1, 1 << 20, zlib.crc32(raw), raw) is True
    st.close()
    st._lock_file.close()  # as the agent's exit would: the next store may open the folder
    blobs = tmp_path / "f" / "blobs"
    with open(blobs / "index.jsonl", "a") as f:  # a power cut in the middle of the next group's append
        f.write('{"sha": "' + sha_c[:20])
    (blobs / sha_c).write_bytes(raw_c)  # and a blob an older agent stored, with its own sidecar
    (blobs / f"{sha_c}.json").write_text('{"dtype": "float32", "shape": [300]}')
    st = FlashStore(tmp_path / "f", lock_wait_s=0)
    assert st.has(sha_a) and st.has(sha_b) and st.has(sha_c)
    assert (np.array_equal(st.get(sha_b), np.frombuffer(raw_b, np.float32))
            and np.array_equal(st.get(sha_c), np.frombuffer(raw_c, np.float32)))
    (sha_d, raw_d) = _blob(203, 900)
    assert st.put_chunk(sha_d, "float32", [900], len(raw_d), 0, 1, 1 << 20, zlib.crc32(raw_d), raw_d) is True
    st.close()
    st._lock_file.close()
    st = FlashStore(tmp_path / "f", lock_wait_s=0)  # the record after the torn line is read back whole
    assert st.has(sha_d) and np.array_equal(st.get(sha_d), np.frombuffer(raw_d, np.float32))
    (blobs / sha_a).unlink()  # a blob whose rename a crash lost is not there, whatever the index says
    assert not st.has(sha_a)
