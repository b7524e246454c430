"""Shared timing helpers for the benchmarks (run them as `python bench/NAME.py`)."""
from __future__ import annotations

import contextlib
import os
import struct
import sys
import time


def best_of(fn, repeat: int, warmup: bool = False) -> float:
    """Smallest wall time of `repeat` calls (after one untimed call when `warmup`): least disturbed by noise."""
    if warmup:
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@contextlib.contextmanager
def cpu_latency_qos(wanted: bool):
    """Hold Linux's PM QoS request of 0 us CPU wake-up latency (/dev/cpu_dma_latency) while the block runs, for
    every process on the machine alike: the kernel keeps idle CPUs polling instead of halting. On a VM that halts
    its idle vCPUs (cpuidle haltpoll with guest_halt_poll_ns=0) waking a thread on the other vCPU costs ~21 us, ~4
    with the request held (bench/agent.py --only handoff); llama.cpp's threads spin between ops instead, so the
    request shows how much of a gap between two runtimes is this wake-up. Needs write access to the file (root)."""
    if not wanted:
        yield
        return
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError as e:
        sys.exit(f"--cpu-latency-qos: cannot open /dev/cpu_dma_latency ({e.strerror}); run as root or leave it out")
    try:
        os.write(fd, struct.pack("i", 0))  # the request lasts while the file stays open
        yield
    finally:
        os.close(fd)


def lane_gaps(events: list) -> tuple[float, float, int]:
    """A trace's time when no op runs, split by what the op after each gap waited for: (us before ops that wait on
    another lane's op, a hand-off; us before the others; how many ops wait on another lane). Each gap runs from the
    latest end so far to the next op's start, so the two sums are the run's idle time."""
    evs = sorted(events, key=lambda e: e["start_us"])
    lane_of = {e["name"]: e["lane"] for e in evs}
    cross = same = 0.0
    handoffs = 0
    end = evs[0]["start_us"]
    for e in evs:
        gap = max(e["start_us"] - end, 0)
        if any(lane_of.get(d, e["lane"]) != e["lane"] for d in e.get("deps", [])):  # waits on another lane
            cross += gap
            handoffs += 1
        else:
            same += gap
        end = max(end, e["end_us"])
    return cross, same, handoffs
