"""The agent under load: four clients decoding at once on two busy cores, each request answered exactly once
(counted at the socket), each run's events and counters its own."""
import subprocess
import sys
import threading
import time
from collections import Counter

import msgpack
import numpy as np
import pytest

from edgeprobe.device import Device
from edgeprobe.plan import prefill_plan

STEPS = (2000, 200, 200, 200)   # decode steps per client, all at once
LAYERS = (1, 2, 3, 4)           # each client's own model: op names and counters tell the runs apart
PROMPT = [3, 1, 4, 1]


def _event_names(plan) -> list:
    """The names a run of the plan reports events under: a step op (a fused op with fused sub-ops: a decode step's
    embedding, layers, final norm and head) reports each sub-op."""
    out = []
    for op in plan["ops"]:
        subs = op.get("attrs", {}).get("ops", []) if op["kind"] == "fused" else []
        out += [s["name"] for s in subs] if any(s["kind"] == "fused" for s in subs) else [op["name"]]
    return out


class CountingSocket:
    """A client's DEALER socket that records the id of every request sent and counts the final replies per id."""

    def __init__(self, sock):
        self._sock = sock
        self.sent: list = []
        self.finals: Counter = Counter()

    def send_multipart(self, frames, **kw):
        self.sent.append(msgpack.unpackb(bytes(frames[0]))["id"])
        return self._sock.send_multipart(frames, **kw)

    def recv_multipart(self, *a, **kw):
        frames = self._sock.recv_multipart(*a, **kw)
        h = msgpack.unpackb(bytes(frames[0]))
        if h.get("final"):
            self.finals[h["id"]] += 1
        return frames

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def drain(self, timeout_s: float = 3.0) -> None:
        """Read what is still on its way (replies to the client's own heartbeats) until every id has its reply."""
        deadline = time.monotonic() + timeout_s
        while set(self.sent) - set(self.finals) and time.monotonic() < deadline:
            if self._sock.poll(100):
                self.recv_multipart()
        while self._sock.poll(200):  # and nothing more arrives
            self.recv_multipart()


class CountingDevice(Device):
    """Device whose socket is a CountingSocket from its first message (hello) on."""

    @property
    def sock(self):
        return self._counting

    @sock.setter
    def sock(self, s):
        self._counting = CountingSocket(s)


def _busy_cores(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.fixture(scope="module")
def models(tiny):
    # client 0 never sees an outlier; the others see every column as one (llm-int8 threshold below |x|)
    return [tiny(L, seed=100 + i, scheme="llm-int8", int8_threshold=1e30 if i == 0 else -1.0)
            for i, L in enumerate(LAYERS)]


def test_four_clients_decode_at_once_on_busy_cores(models, tmp_path):
    owner = Device.local(store=tmp_path / "st")
    busy = _busy_cores(2)
    results, errors = [None] * len(STEPS), []

    def client(i):
        try:
            dev = CountingDevice.connect(owner.url)
            qm = models[i]
            lat = []
            with dev.session(qm, len(PROMPT) + STEPS[i], name=f"load{i}", progress=False) as s:
                s.prefill(PROMPT)
                prefill_events = list(s.events)
                tok = np.array([0])
                for k in range(STEPS[i]):
                    t0 = time.perf_counter()
                    logits = s.step(tok)  # sent the moment the previous reply is read
                    lat.append(time.perf_counter() - t0)
                    tok = np.argmax(logits, axis=-1)
            dev.sock.drain()
            results[i] = {"lat": lat, "events": s.events, "prefill_events": prefill_events,
                          "counters": s.step_counters, "sent": list(dev.sock.sent), "finals": Counter(dev.sock.finals)}
            dev.close(shutdown=False)
        except Exception as e:  # counted and shown below: the test wants zero
            errors.append(f"client {i}: {type(e).__name__}: {e}")

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(STEPS))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        wall = time.perf_counter() - t0
        stats = owner.stats()
    finally:
        for p in busy:
            p.kill()
            p.wait()
        owner.close()
    assert not errors, errors
    lat = np.concatenate([r["lat"] for r in results]) * 1e3
    print(f"\nload: {sum(STEPS)} decode steps from {len(STEPS)} clients ({'/'.join(map(str, STEPS))}) beside 2 busy "
          f"processes on {len(__import__('os').sched_getaffinity(0))} cores: {wall:.1f} s, "
          f"{sum(STEPS) / wall:.0f} steps/s, "
          f"step latency p50 {np.percentile(lat, 50):.2f} ms, p99 {np.percentile(lat, 99):.2f} ms, "
          f"max {lat.max():.1f} ms; "
          f"errors {len(errors)}; agent served {stats['served']}, errors {stats['errors']}")
    assert stats["errors"] == 0 and stats["runs_in_flight"] == 0
    for i, r in enumerate(results):
        # exactly one final reply per request, and none for an id never sent
        assert len(r["sent"]) == len(set(r["sent"])) and set(r["finals"]) == set(r["sent"]), i
        assert all(n == 1 for n in r["finals"].values()), [(k, n) for k, n in r["finals"].items() if n != 1][:5]
        # each step's events are exactly its own plan's ops: no event of another client's run (other layers)
        names = Counter(_event_names(prefill_plan(models[i].manifest, 1, session=True)))
        by_step: dict = {}
        for e in r["events"]:
            by_step.setdefault(e["group"], []).append(e)
        assert len(by_step) == STEPS[i] + 1
        for g in (f"step{k}" for k in range(STEPS[i])):
            assert Counter(e["name"] for e in by_step[g]) == names, (i, g)
        # the prefill read this client's blobs from flash, and only its own
        reads = {e["blob"] for e in r["prefill_events"] if e["kind"] == "flash_read"}
        own = set(models[i].manifest["blobs"])
        assert reads and reads <= own, i
        # counters add up per run: every column of every llm-int8 linear is an outlier, in this client's runs only
        per_run = sum(rec["shape"][1] for rec in models[i].manifest["linears"].values() if rec["kind"] == "llm-int8")
        want = 0 if i == 0 else per_run
        assert [c.get("outlier_columns", 0) for c in r["counters"]] == [want] * STEPS[i], i
