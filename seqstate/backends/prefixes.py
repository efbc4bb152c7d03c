"""Prefilling rows through an engine's store: each prefix computed once.

`ensure_stored` is the algorithm both engines share: what a store already holds is reused,
prefixes that several rows share are computed once before the rows' own tails, and the
engine only supplies how a batch of uncached tails is run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["SHARED_PREFIX_MIN", "common_prefix", "shared_prefixes", "ensure_stored"]

SHARED_PREFIX_MIN = 16        # a shared uncached prefix this long is prefilled once for all


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefixes(targets: list[tuple[int, ...]], cached: list[int]) -> list[tuple[int, ...]]:
    """Prefixes shared by two or more targets that extend well past what is cached."""
    order = sorted(range(len(targets)), key=lambda i: targets[i])
    shared = set()
    for a, b in itertools.pairwise(order):
        lcp = common_prefix(targets[a], targets[b])
        if (lcp - max(cached[a], cached[b]) >= SHARED_PREFIX_MIN
                and lcp < max(len(targets[a]), len(targets[b]))):
            shared.add(targets[a][:lcp])
    # keep only the shortest of nested shared prefixes; longer ones are found next round
    return [p for p in shared if not any(q != p and p[:len(q)] == q for q in shared)]


def ensure_stored(store: Any, rows: Sequence[Sequence[int]],
                  run_tails: Callable[[list[tuple[tuple[int, ...], Any]]], list[Any]],
                  count: Callable[..., None]) -> list[Any]:
    """Make sure ``row[:-1]`` of every row is in ``store``; pinned handles on each.

    ``run_tails(todo)`` computes the uncached tail of each ``(target, stored handle)`` and
    returns pinned handles on the stored targets.  The last token of each row is left for
    the first decode step, which produces its logits.  ``cached_tokens_reused`` counts the
    tokens of distinct rows already stored at the start.
    """
    targets = [tuple(r[:-1]) for r in rows]
    unique = list(dict.fromkeys(targets))
    count(cached_tokens_reused=sum(store.match(t).length for t in unique))
    pins: list[Any] = []          # keeps what this call stored from eviction until it returns
    _prefill(store, unique, run_tails, pins)
    return [store.match(t) for t in targets]


def _prefill(store: Any, targets: list[tuple[int, ...]], run_tails: Callable, pins: list) -> None:
    while True:
        handles = [store.match(t) for t in targets]
        todo = [(t, h) for t, h in zip(targets, handles) if h.length < len(t)]
        if not todo:
            return
        shared = shared_prefixes([t for t, _ in todo], [h.length for _, h in todo])
        if shared:
            _prefill(store, shared, run_tails, pins)
            continue
        pins.extend(run_tails(todo))
