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
    returns pinned handles on the stored targets, one per item of ``todo``, in its order
    (they are the only way to this call's scratch KV, which no match finds).  The last token
    of each row is left for the first decode step, which produces its logits.
    ``cached_tokens_reused`` counts the tokens of distinct rows already stored at the start.
    """
    targets = [tuple(r[:-1]) for r in rows]
    unique = list(dict.fromkeys(targets))
    count(cached_tokens_reused=sum(store.match(t).length for t in unique))
    # what this call computed: pinned until it returns, and found here even where the store
    # will not match it (scratch KV, computed inside `frozen_store()`)
    made: dict[tuple[int, ...], Any] = {}
    _prefill(store, unique, run_tails, made)
    return [_lookup(store, t, made) for t in targets]


def _lookup(store: Any, target: tuple[int, ...], made: dict[tuple[int, ...], Any]) -> Any:
    """A handle on the longest prefix of ``target`` with KV: stored, or made by this call."""
    hit = made.get(target)
    ours = [hit] if hit is not None else [h for done, h in made.items()
                                          if target[:len(done)] == done]
    return max([store.match(target), *ours], key=lambda h: h.length)


def _prefill(store: Any, targets: list[tuple[int, ...]], run_tails: Callable,
             made: dict[tuple[int, ...], Any]) -> None:
    while True:
        handles = [_lookup(store, t, made) for t in targets]
        todo = [(t, h) for t, h in zip(targets, handles) if h.length < len(t)]
        if not todo:
            return
        shared = shared_prefixes([t for t, _ in todo], [h.length for _, h in todo])
        if shared:
            _prefill(store, shared, run_tails, made)
            continue
        made.update(zip([t for t, _ in todo], run_tails(todo)))
