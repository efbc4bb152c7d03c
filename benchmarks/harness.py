"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeat: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn`` in seconds after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(title: str, rows: list[tuple[str, float, str]], baseline: str) -> None:
    """Print ``(name, seconds, note)`` rows with each one's speed relative to ``baseline``."""
    base = dict((n, t) for n, t, _ in rows)[baseline]
    print(f"\n== {title}")
    for name, t, note in rows:
        print(f"  {name:<34} {t * 1000:9.1f} ms   {base / t:6.2f}x vs {baseline}  {note}")
