"""The handle both KV stores give out: a pinned prefix of a path in a radix tree."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["PinnedPrefix"]


class PinnedPrefix:
    """A pinned reference to the KV of the first ``length`` tokens of a stored path.

    ``node`` is the tree node the prefix ends in (it has ``start`` and ``parent``) and ``rel``
    how many of its tokens are included.  While the handle is alive the store keeps the node,
    and so every ancestor (``store._pin(node, +1)``; the matching ``-1`` runs when the handle
    is collected).  Handles are immutable and shared freely between states.
    """

    __slots__ = ("__weakref__", "node", "rel", "store")

    def __init__(self, store: Any, node: Any, rel: int) -> None:
        self.store = store
        self.node = node
        self.rel = rel                                # tokens of `node` included
        store._pin(node, +1)
        weakref.finalize(self, store._pin, node, -1)

    @property
    def length(self) -> int:
        """Number of tokens, from position 0, whose KV this handle names."""
        return self.node.start + self.rel

    def prefix(self, n: int) -> PinnedPrefix:
        """A handle on the first ``n`` tokens (``n`` is clipped to this handle's length)."""
        n = max(0, min(n, self.length))
        if n == self.length:
            return self
        node = self.node
        while node.parent is not None and n <= node.start:
            node = node.parent
        return type(self)(self.store, node, n - node.start)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self.length})"
