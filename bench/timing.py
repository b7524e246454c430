"""Shared timing helper for the benchmarks (run them as `python bench/NAME.py`)."""
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
