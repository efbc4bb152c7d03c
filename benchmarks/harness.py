"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import time
from collections.abc import Callable


def steady_allocator() -> str:
    """Pin glibc's malloc to one policy for the rest of the process and say which.

    By default glibc moves its mmap threshold up as large blocks are freed and hands memory
    back to the system when the top of a heap frees, so whether a loop's (64, 49152) float
    tensors cost their page faults again at every step depends on what the process did
    before (docs/performance.md).  Pinned (blocks under 32 MiB from the heaps, heaps never
    trimmed), every loop of a suite runs as it does at its best, whatever ran first."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        gnu = libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        return "allocator: the platform's, as it is (not glibc)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    gnu.restype = ctypes.c_char_p
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 1 << 30)):
        return "allocator: glibc's own moving thresholds (mallopt refused)"
    return (f"allocator: glibc {gnu().decode()} pinned (blocks under 32 MiB from its heaps, "
            "heaps never trimmed): page faults the same in every loop, whatever ran first")


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
