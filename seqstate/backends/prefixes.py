"""Finding prefixes that several rows of one call share, so each is computed once."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["SHARED_PREFIX_MIN", "common_prefix", "shared_prefixes"]

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
