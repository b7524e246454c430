"""The device agent, side by side in one run.

1. Upload throughput of the same blobs over ZeroMQ (Device.upload: chunked, CRC-checked, sha256-verified, durable
   when acknowledged) and over paramiko SFTP (`sftp.put`, default settings) to a real sshd on loopback, on
   synthetic 4 MB blobs (`--mb`) and on SmolLM2's real w8a8-shadow blobs (`--real`). Rounds alternate
   ZeroMQ / SFTP; medians and the ratio are printed (goal >= 10x), with what bounds a durable upload measured
   in the same run: the disk's write+fsync bandwidth, its sustained write bandwidth without fsync, and sha256's
   rate. With TMPDIR=/dev/shm both land in memory: the two protocols with no disk in the way.
2. Prefill tokens/s at 256 tokens of SmolLM2 w8a8-shadow on a local agent (npu lane emulated, cpu lane)
   beside the host's float forward pass and the host's simulation of the same scheme.
3. What a hand-off between lanes costs: chains of one-row adds on one lane and alternating two lanes, in turns
   (µs an op), beside two bare threads handing a threading.Event back and forth (the machine's floor for a
   thread's wake-up); and how many hand-offs a warm 64-token w8a8-shadow prefill makes, beside the time in it when no
   lane computes (EDGEPROBE_LANE_THREADS=auto unless set, as bench/vs_llamacpp.py runs).

    .venv/bin/python bench/agent.py [--mb 64] [--tokens 256] [--rounds 3] [--real | --no-real]
        [--only upload|prefill|handoff] [--cpu-latency-qos]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from timing import best_of, cpu_latency_qos, lane_gaps


class _Blobs:
    """A QuantizedModel-shaped holder of random blobs (what Device.upload needs)."""

    def __init__(self, mb: int, size: int = 4 << 20):
        rng = np.random.default_rng(0)
        self.arrays = {}
        for _ in range(max(1, (mb << 20) // size)):
            a = rng.integers(0, 255, size, dtype=np.uint8)
            self.arrays[hashlib.sha256(a).hexdigest()] = a
        self.manifest = {"blobs": {s: {"nbytes": a.nbytes} for s, a in self.arrays.items()}}
        self.store = self
        self.nbytes = sum(a.nbytes for a in self.arrays.values())

    def get(self, sha):
        return self.arrays[sha]


class _Real(_Blobs):
    """SmolLM2-135M's w8a8-shadow blobs, as the demo uploads them."""

    def __init__(self):
        from edgeprobe import models
        from edgeprobe.corpus import read_corpus
        from edgeprobe.quant import calibration_profile, quantize

        m = models.load("smollm2-135m")
        prof = calibration_profile(m, m.tokenizer.encode(read_corpus("train")), tokens=256, window=256, progress=False)
        qm = quantize(m, "w8a8-shadow", prof)
        self.arrays = {s: np.ascontiguousarray(qm.store.get(s)) for s in qm.manifest["blobs"]}
        self.manifest, self.store = {"blobs": qm.manifest["blobs"]}, self
        self.nbytes = sum(a.nbytes for a in self.arrays.values())


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_and_sha(nbytes: int, folder: Path) -> tuple[float, float, float]:
    """This disk's write+fsync bandwidth, its sustained write bandwidth without any fsync (the third of three
    writes in a row: the page cache absorbs a burst, then the kernel throttles writers to what the disk takes)
    and sha256's rate, in bytes/s on `nbytes` of random bytes: the floors of any durable, verified upload, and of
    any upload at all that lands on this disk."""
    buf = np.random.default_rng(1).integers(0, 255, min(nbytes, 256 << 20), dtype=np.uint8)
    t = time.perf_counter()
    with open(folder / "disk.bin", "wb") as f:
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    disk = buf.nbytes / (time.perf_counter() - t)
    for i in range(3):
        t = time.perf_counter()
        with open(folder / f"burst{i}.bin", "wb") as f:
            f.write(buf)
        sustained = buf.nbytes / (time.perf_counter() - t)
    for p in folder.glob("*.bin"):
        p.unlink()
    t = time.perf_counter()
    hashlib.sha256(buf).digest()
    return disk, sustained, buf.nbytes / (time.perf_counter() - t)


def upload(mb: int, rounds: int = 3, real: bool = True) -> None:
    """Alternate ZeroMQ and SFTP uploads of each blob set `rounds` times; print medians and ratios."""
    import getpass

    from edgeprobe.deploy import _client, start_local_sshd
    from edgeprobe.device import Device

    sets = [(f"{mb} MB synthetic", _Blobs(mb))] + ([("SmolLM2 w8a8-shadow", _Real())] if real else [])
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tmp_root = tmp.parent  # TMPDIR=/dev/shm: the stores and SFTP's files in memory, the protocols without the disk
        proc, info = start_local_sshd(tmp / "sshd")
        try:
            c = _client("127.0.0.1", getpass.getuser(), info["key"], info["port"], info["known_hosts"], None)
            sftp = c.open_sftp()
            for name, blobs in sets:
                src = tmp / "src"
                src.mkdir()
                for s, a in blobs.arrays.items():
                    a.tofile(src / s)
                times = {"zmq": [], "sftp": [], "sync": []}
                for r in range(rounds):
                    with Device.local(store=tmp / f"agent{r}") as dev:  # a fresh store each round: every blob goes up
                        t = time.perf_counter()
                        sent = dev.upload(blobs, progress=False)
                        times["zmq"].append(time.perf_counter() - t)
                        assert sent == blobs.nbytes
                        assert len(dev.request("has_blobs", ids=list(blobs.arrays))[0]["have"]) == len(blobs.arrays)
                    shutil.rmtree(tmp / f"agent{r}")
                    dst = tmp / f"sftp{r}"
                    sftp.mkdir(str(dst))
                    t = time.perf_counter()
                    for s in blobs.arrays:
                        sftp.put(str(src / s), f"{dst}/{s}")
                    times["sftp"].append(time.perf_counter() - t)
                    t = time.perf_counter()  # what SFTP would add to be as durable as an acknowledged ZeroMQ upload
                    for s in blobs.arrays:
                        _fsync(dst / s)
                    _fsync(dst)
                    times["sync"].append(time.perf_counter() - t)
                    shutil.rmtree(dst)
                shutil.rmtree(src)
                z, f, y = (statistics.median(times[k]) for k in ("zmq", "sftp", "sync"))
                mbs = blobs.nbytes / 1e6
                print(f"upload {name}: {mbs:.0f} MB in {len(blobs.arrays)} blobs, median of {rounds} alternating "
                      f"rounds: ZeroMQ {mbs / z:6.0f} MB/s ({z:.2f} s)   "
                      f"paramiko SFTP {mbs / f:5.1f} MB/s ({f:.2f} s)   ratio {f / z:.1f}x   "
                      f"(SFTP + fsync of its files {(f + y) / z:.1f}x)")
                print(f"    rounds ZeroMQ {' '.join(f'{x:.2f}' for x in times['zmq'])} s; SFTP "
                      f"{' '.join(f'{x:.2f}' for x in times['sftp'])} s")
            c.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        disk, sustained, sha = _disk_and_sha(max(b.nbytes for _, b in sets), tmp)
    print(f"bounds here ({tmp_root}): disk write+fsync {disk / 1e6:.0f} MB/s, sustained write without fsync "
          f"{sustained / 1e6:.0f} MB/s, sha256 {sha / 1e6:.0f} MB/s; load average after: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def prefill(tokens: int, repeat: int) -> None:
    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.device import Device
    from edgeprobe.forward import forward
    from edgeprobe.quant import calibration_profile, quantize

    m = models.load("smollm2-135m")
    m.weights.materialize()
    ids = m.tokenizer.encode(read_corpus("heldout"))[:tokens]
    qm = quantize(m, "w8a8-shadow", calibration_profile(m, m.tokenizer.encode(read_corpus("train")), progress=False))
    host_float = best_of(lambda: forward(m, ids, logits="last"), repeat, warmup=True)
    host_sim = best_of(lambda: qm.forward(ids, logits="last"), repeat, warmup=True)
    with tempfile.TemporaryDirectory() as tmp, Device.local(store=tmp) as dev:
        dev.prefill(qm, ids, progress=False)  # upload + JIT + first reads from flash
        runs = [dev.prefill(qm, ids, progress=False) for _ in range(repeat)]
    best = min(runs, key=lambda r: r.trace.metrics()["makespan_ms"])
    mk = best.trace.metrics()
    agent_s = mk["makespan_ms"] / 1e3
    busy = ", ".join(f"{k} {v['busy_pct']:.0f}%" for k, v in mk["lanes"].items())
    print(f"prefill {tokens} tokens: host float {tokens / host_float:6.0f} tok/s   host w8a8-shadow simulation "
          f"{tokens / host_sim:6.0f} tok/s   agent w8a8-shadow {tokens / agent_s:6.0f} tok/s "
          f"(makespan {mk['makespan_ms']:.0f} ms; "
          f"busy {busy})   agent/host-float {host_float / agent_s:.2f}   agent/host-sim {host_sim / agent_s:.2f}")


def _chain(n: int, lanes: list) -> dict:
    """A plan of n one-row adds, each reading the last: on one lane, or alternating lanes (a hand-off an op)."""
    ops = [{"name": "a0", "kind": "add", "lane": lanes[0], "inputs": [{"input": "x"}, {"input": "x"}]}]
    ops += [{"name": f"a{i}", "kind": "add", "lane": lanes[i % len(lanes)],
             "inputs": [{"op": f"a{i - 1}"}, {"input": "x"}]} for i in range(1, n)]
    return {"ops": ops, "outputs": [f"a{n - 1}"]}


def _event_ping_pong(n: int = 5000) -> float:
    """µs a hand-off between two bare Python threads through threading.Event: this machine's floor for what a lane
    thread waking for another lane's op costs."""
    import threading

    ping, pong = threading.Event(), threading.Event()

    def serve():
        for _ in range(n):
            ping.wait()
            ping.clear()
            pong.set()
    t = threading.Thread(target=serve)
    t.start()
    t0 = time.perf_counter()
    for _ in range(n):
        ping.set()
        pong.wait()
        pong.clear()
    dt = time.perf_counter() - t0
    t.join()
    return dt / (2 * n) * 1e6


def handoff(repeat: int, n: int = 400, qos: bool = False) -> None:
    """What a hand-off between lanes costs (a lane thread wakes when the other lane's op it waits for ends), beside
    an op on the same lane, and how many a warm 64-token w8a8-shadow prefill makes: the part of its time no
    kernel bounds (docs/benchmarks.md). qos: each measurement also with a PM QoS request of 0 us wake-up latency
    held (timing.cpu_latency_qos), in turns with it released: how much of a hand-off is the machine's idle exit."""
    import numpy as np

    from edgeprobe import models
    from edgeprobe.corpus import read_corpus
    from edgeprobe.device import Device
    from edgeprobe.prepare import prepared

    os.environ.setdefault("EDGEPROBE_LANE_THREADS", "auto")  # the agent below inherits it
    x = np.ones((1, 576), np.float32)
    modes = [False, True] if qos else [False]
    per_op: dict = {(q, what): [] for q in modes for what in ("one lane", "two lanes, alternating")}
    floor: dict = {q: [] for q in modes}
    runs: dict = {q: [] for q in modes}
    with tempfile.TemporaryDirectory() as tmp, Device.local(store=tmp) as dev:
        plans = {"one lane": dev.put_plan(_chain(n, ["cpu"])),
                 "two lanes, alternating": dev.put_plan(_chain(n, ["cpu", "npu"]))}
        for pid in plans.values():
            dev.run(pid, {"x": x})
        for _ in range(repeat):  # in turns: both see the same machine
            for q in modes:
                with cpu_latency_qos(q):
                    for what, pid in plans.items():
                        ev = dev.run(pid, {"x": x}).trace.events
                        per_op[q, what].append((max(e["end_us"] for e in ev) - min(e["start_us"] for e in ev)) / n)
                    floor[q].append(_event_ping_pong())
        m = models.load("smollm2-135m")
        ids = m.tokenizer.encode(read_corpus("heldout"))[:64]
        qm = prepared(m, "w8a8-shadow", say=print)
        dev.prefill(qm, ids, progress=False)  # upload, runners, layouts
        for _ in range(repeat):
            for q in modes:
                with cpu_latency_qos(q):
                    runs[q].append(dev.prefill(qm, ids, progress=False))
    print(f"EDGEPROBE_LANE_THREADS={os.environ['EDGEPROBE_LANE_THREADS']}; load average {os.getloadavg()[0]:.2f}")
    for q in modes:
        one, two = (statistics.median(per_op[q, what]) for what in plans)
        held = "PM QoS 0 us held" if q else "machine as it is"
        print(f"{held}: a chain of {n} one-row adds (medians of {repeat}): {one:.1f} us an op on one lane, {two:.1f} "
              f"us alternating lanes: a hand-off costs ~{two - one:.1f} us more; two bare threads handing an Event "
              f"back and forth in this process: {statistics.median(floor[q]):.1f} us a hand-off")
        best = min(runs[q], key=lambda r: r.trace.metrics()["makespan_ms"])
        cross, same, handoffs = lane_gaps(best.trace.events)
        print(f"   a warm 64-token w8a8-shadow prefill (best of {repeat}): makespan "
              f"{best.trace.metrics()['makespan_ms']:.1f} ms, {len(best.trace.events)} ops, {handoffs} cross-lane "
              f"hand-offs (~{handoffs * (two - one) / 1e3:.1f} ms at the chain's cost), no lane computing "
              f"{(cross + same) / 1e3:.1f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternating ZeroMQ / SFTP upload rounds per blob set")
    ap.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                    help="also upload SmolLM2's w8a8-shadow blobs (quantizes it first, ~20 s)")
    ap.add_argument("--only", choices=["upload", "prefill", "handoff"])
    ap.add_argument("--cpu-latency-qos", action="store_true",
                    help="hand-offs: each measurement also with a PM QoS request of 0 us CPU wake-up latency held "
                         "(/dev/cpu_dma_latency, root), in turns")
    args = ap.parse_args()
    if args.only in (None, "upload"):
        upload(args.mb, args.rounds, args.real)
    if args.only in (None, "prefill"):
        prefill(args.tokens, args.repeat)
    if args.only in (None, "handoff"):
        handoff(max(args.repeat, 5), qos=args.cpu_latency_qos)


if __name__ == "__main__":
    main()
