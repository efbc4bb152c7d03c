"""Prefilling rows through an engine's store: each prefix computed once.

`ensure_stored` is the algorithm both engines share: what a store already holds is reused,
prefixes that several rows share are computed once before the rows' own tails, and the
engine only supplies how a batch of uncached tails is run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["SHARED_PREFIX_MIN", "common_prefix", "shared_prefixes", "trie_size", "ensure_stored",
           "ensure_shared"]

# a shared uncached prefix this long is prefilled once for all: any length, so the tokens
# computed are exactly the trie of the rows (a round per level of nesting; a short prefix
# recomputed per row would cost a few tokens a row and break the count)
SHARED_PREFIX_MIN = 1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def trie_size(paths: Sequence[tuple[int, ...]]) -> tuple[int, int]:
    """(distinct token prefixes, paths that are no prefix of another): the tokens and the
    branch tips of ``paths`` stored together, each shared prefix once."""
    ordered = sorted(set(paths))
    cells = leaves = 0
    for i, p in enumerate(ordered):
        cells += len(p) - (common_prefix(p, ordered[i - 1]) if i else 0)
        nxt = ordered[i + 1] if i + 1 < len(ordered) else None
        leaves += bool(p) and not (nxt is not None and nxt[:len(p)] == p)
    return cells, leaves


def shared_prefixes(targets: list[tuple[int, ...]], cached: list[int]) -> list[tuple[int, ...]]:
    """Prefixes shared by two or more targets that extend past what is cached."""
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
    """Make sure ``row[:-1]`` of every row is in ``store``; hard-pinned handles on each (the
    caller's work in progress: it drops them once it holds that KV otherwise).

    ``run_tails(todo)`` computes the uncached tail of each ``(target, stored handle)`` and
    returns hard-pinned handles on the stored targets, one per item of ``todo``, in its order
    (they are the only way to this call's scratch KV, which no match finds).  The last token
    of each row is left for the first decode step, which produces its logits.
    ``cached_tokens_reused`` counts the tokens of distinct rows already stored at the start,
    ``recomputed_tokens`` those to compute again because their KV, which a live state
    referred to, was evicted (each shared prefix once).
    """
    targets = [tuple(r[:-1]) for r in rows]
    unique = _account(store, targets, count)
    # what this call computed: pinned until it returns, and found here even where the store
    # will not match it (scratch KV, computed inside `frozen_store()`)
    made: dict[tuple[int, ...], Any] = {}
    _prefill(store, unique, run_tails, made)
    return [_lookup(store, t, made) for t in targets]


def ensure_shared(store: Any, targets: Sequence[Sequence[int]],
                  run_tails: Callable[[list[tuple[tuple[int, ...], Any]]], list[Any]],
                  count: Callable[..., None]) -> list[Any]:
    """`ensure_stored` without the targets' own tails: only what two or more ``targets``
    share beyond the store is computed (once, nested shares by rounds).  Returns a
    hard-pinned handle per target on its longest prefix with KV, for the caller to feed the
    rest (a tail no other target shares) in its own forward."""
    targets = [tuple(t) for t in targets]
    unique = _account(store, targets, count)
    made: dict[tuple[int, ...], Any] = {}
    while shared := shared_prefixes(unique, [_lookup(store, t, made).length for t in unique]):
        _prefill(store, shared, run_tails, made)
    return [_lookup(store, t, made) for t in targets]


def _account(store: Any, targets: list[tuple[int, ...]], count: Callable[..., None]
             ) -> list[tuple[int, ...]]:
    """The distinct targets, having counted what the store holds of them and what it lost."""
    unique = list(dict.fromkeys(targets))
    stored = [store.match(t).length for t in unique]
    count(cached_tokens_reused=sum(stored))
    if store.tree.lost_count:
        lost = [t[:store.tree.lost_end(t)] for t in unique]
        again = trie_size(lost)[0] - trie_size([t[:n] for t, n in zip(unique, stored)])[0]
        count(recomputed_tokens=again)
    return unique


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
