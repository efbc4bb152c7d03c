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


def interleaved(fns: list[Callable[[], object]], repeat: int = 7, warmup: int = 1) -> list[float]:
    """Median wall time of each of ``fns``, timed in turns (A B A B ...) so that a machine
    getting faster or slower over the run (other processes, clocks) affects every one alike."""
    return [statistics.median(t) for t in interleaved_runs(fns, repeat, warmup)]


def interleaved_runs(fns: list[Callable[[], object]], repeat: int = 7,
                     warmup: int = 1) -> list[list[float]]:
    """Every run's wall time of each of ``fns``, timed in turns (see `interleaved`)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return times


def report(title: str, rows: list[tuple[str, float, str]], baseline: str) -> None:
    """Print ``(name, seconds, note)`` rows with each one's speed relative to ``baseline``."""
    base = dict((n, t) for n, t, _ in rows)[baseline]
    print(f"\n== {title}")
    for name, t, note in rows:
        print(f"  {name:<34} {t * 1000:9.1f} ms   {base / t:6.2f}x vs {baseline}  {note}")
