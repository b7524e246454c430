"""The device agent, side by side in one run.

1. Upload throughput of the same blobs over ZeroMQ (Device.upload: chunked, checksummed) and over
   paramiko SFTP to a real sshd on loopback: MB/s each and the ratio (goal >= 10x).
2. Prefill tokens/s at 256 tokens of SmolLM2 w8a8-shadow on a local agent (npu lane emulated, cpu lane)
   beside the host's float forward pass and the host's simulation of the same scheme.

    .venv/bin/python bench/agent.py [--mb 64] [--tokens 256]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from timing import best_of


class _Blobs:
    """A QuantizedModel-shaped holder of random blobs (what Device.upload needs)."""

    def __init__(self, mb: int, size: int = 4 << 20):
        import hashlib

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


def upload(mb: int) -> None:
    from edgeprobe.deploy import _client, start_local_sshd
    from edgeprobe.device import Device

    blobs = _Blobs(mb)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with Device.local(store=tmp / "agent") as dev:
            t = time.perf_counter()
            sent = dev.upload(blobs, progress=False)
            zmq_s = time.perf_counter() - t
        assert sent == blobs.nbytes
        src = tmp / "src"
        src.mkdir()
        for s, a in blobs.arrays.items():
            a.tofile(src / s)
        proc, info = start_local_sshd(tmp / "sshd")
        try:
            import getpass

            c = _client("127.0.0.1", getpass.getuser(), info["key"], info["port"], info["known_hosts"], None)
            sftp = c.open_sftp()
            dst = str(tmp / "sftp-dst")
            sftp.mkdir(dst)
            t = time.perf_counter()
            for s in blobs.arrays:
                sftp.put(str(src / s), f"{dst}/{s}")
            sftp_s = time.perf_counter() - t
            c.close()
        finally:
            proc.terminate()
    mbs = blobs.nbytes / 1e6
    print(f"upload {mbs:.0f} MB: ZeroMQ {mbs / zmq_s:8.1f} MB/s ({zmq_s:.2f} s)   paramiko SFTP {mbs / sftp_s:6.1f} MB/s "
          f"({sftp_s:.2f} s)   ratio {sftp_s / zmq_s:.1f}x")


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
          f"{tokens / host_sim:6.0f} tok/s   agent w8a8-shadow {tokens / agent_s:6.0f} tok/s (makespan {mk['makespan_ms']:.0f} ms; "
          f"busy {busy})   agent/host-float {host_float / agent_s:.2f}   agent/host-sim {host_sim / agent_s:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    upload(args.mb)
    prefill(args.tokens, args.repeat)


if __name__ == "__main__":
    main()
