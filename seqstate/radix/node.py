"""The tree's nodes and the handles that name a prefix of a path (hard pins, soft references).

The rules they follow are the package's (`seqstate.radix`); the tree (`seqstate.radix.tree`)
keeps their counts.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["Node", "PinnedPrefix"]


class Node:
    """A span of stored tokens, hanging off ``parent`` after ``offset`` of its tokens.

    ``start`` is the position of the first token in the path; ``pins`` counts hard pins
    ending in this node (and scratch children hanging off it); ``refs`` counts soft
    references ending in this node or below it; ``last_used`` is the tick of the last walk
    that reached it; ``scratch`` marks a node no walk may reach; ``lost`` holds the evicted
    children that live states still refer to, by offset and first token (several may share
    one place: a child evicted, stored again and evicted again).
    """

    __slots__ = ("__weakref__", "children", "last_used", "lost", "offset", "parent", "pins",
                 "refs", "scratch", "start", "tokens")

    def __init__(self, parent: Node | None, offset: int, tokens: tuple[int, ...]) -> None:
        self.parent = parent
        self.offset = offset                          # parent tokens that precede this node
        self.start = 0 if parent is None else parent.start + offset
        self.tokens = tokens
        self.children: dict[int, dict[int, Node]] = {}   # offset -> first token -> child
        self.lost: dict[tuple[int, int], list[Node]] = {}  # (offset, token) -> lost children
        self.pins = 0
        self.refs = 0
        self.last_used = 0
        self.scratch = False

    @property
    def end(self) -> int:
        """Position just past this node's last token."""
        return self.start + len(self.tokens)

    @property
    def weight(self) -> int:
        """What the tree accounts for this node (tokens here; payloads count bytes, cells).
        Constant over the node's life."""
        return len(self.tokens)

    def child(self, offset: int, token: int) -> Node | None:
        return self.children.get(offset, {}).get(token)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(start={self.start}, len={len(self.tokens)}, "
                f"pins={self.pins}, refs={self.refs})")


class PinnedPrefix:
    """A reference to the first ``length`` tokens of a stored path: a hard pin or a soft one.

    ``node`` is the node the prefix ends in and ``rel`` how many of its tokens are included.
    While a *hard* handle is alive ``tree`` keeps the node, and so every ancestor
    (``tree._pin(node, +1)``; the matching ``-1`` runs when the handle is collected): work in
    progress holds these.  A *soft* handle (`soft`) only marks its path live (``refs``):
    the tree may evict it under pressure, after which `stored` is False and the tokens are
    computed again when needed.  Live states hold soft handles.  Handles are immutable and
    shared freely between states.
    """

    __slots__ = ("__weakref__", "hard", "node", "rel", "tree")

    def __init__(self, tree: Any, node: Any, rel: int, hard: bool = True) -> None:
        self.tree = tree
        self.node = node
        self.rel = rel                                # tokens of `node` included
        self.hard = hard
        change = tree._pin if hard else tree._ref
        change(node, +1)
        weakref.finalize(self, change, node, -1)

    @property
    def length(self) -> int:
        """Number of tokens, from position 0, this handle names."""
        return self.node.start + self.rel

    def prefix(self, n: int) -> PinnedPrefix:
        """A handle on the first ``n`` tokens (``n`` is clipped to this handle's length)."""
        n = max(0, min(n, self.length))
        if n == self.length:
            return self
        node = self.node
        while node.parent is not None and n <= node.start:
            node = node.parent
        return type(self)(self.tree, node, n - node.start, self.hard)

    def soft(self) -> PinnedPrefix:
        """A soft handle on the same prefix (what a state keeps): live, yet evictable."""
        return self if not self.hard else type(self)(self.tree, self.node, self.rel, False)

    @property
    def stored(self) -> bool:
        """Whether this prefix's KV is still in the store (False once its node was evicted;
        a scratch prefix is kept while any handle refers to it)."""
        return self.node.scratch or self.tree._linked(self.node)

    def __repr__(self) -> str:
        kind = "" if self.hard else ", soft"
        return f"{type(self).__name__}(length={self.length}{kind})"
