"""Shared timing helpers for the benchmarks (run them as `python bench/NAME.py`)."""
from __future__ import annotations

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
