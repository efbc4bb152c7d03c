"""`RadixTree`: the longest-prefix walk, linking and unlinking nodes with their accounting,
pins and references, and the least-recently-used order of evictable nodes (see
`seqstate.radix`)."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from seqstate.radix.node import Node, PinnedPrefix

__all__ = ["RadixTree"]

N = TypeVar("N", bound=Node)


class RadixTree(Generic[N]):
    """The tree, its pins and accounting, and the LRU order of evictable nodes.

    Thread-safe: every method takes ``lock`` (re-entrant, as a handle's finalizer may unpin
    from inside another operation when garbage collection runs there).

    Parameters
    ----------
    root : Node
        An empty node of the engine's payload type (no parent, no tokens); never evicted.
    handle : type of PinnedPrefix
        The class of the handles `match` and `handle` give out.
    release : callable, optional
        ``release(node)`` frees a scratch node's payload when its last pin goes (under
        ``lock``, possibly from a handle's finalizer on any thread).
    """

    def __init__(self, root: N, handle: type[PinnedPrefix] = PinnedPrefix,
                 release: Callable[[N], None] | None = None) -> None:
        if root.parent is not None or root.tokens:
            raise ValueError(f"the root must have no parent and no tokens, got {root!r}")
        self.root = root
        self.handle_type = handle
        self.release = release
        self.lock = threading.RLock()
        self.size = 0                                 # total weight of every node but the root
        self.held = 0                                 # weight of live nodes (soft references)
        self.count = 0                                # nodes but the root
        self.evictions = 0                            # nodes removed
        self.live_evictions = 0                       # of those, live ones (then lost)
        self.lost_count = 0                           # lost nodes still referenced
        self.frozen = 0                               # open `freeze()` blocks
        self.scratch_count = 0                        # live scratch nodes (in no count above)
        self.scratch_size = 0                         # their weight
        self._tick = itertools.count(1)
        self._evictable: set[N] = set()
        # (last_used, tie-break, node): an entry is current while the node is evictable and
        # its last_used is unchanged; stale entries are skipped on pop, dropped on rebuild
        self._lru: list[tuple[int, int, N]] = []
        self._order = itertools.count()

    # -- lookup -------------------------------------------------------------------------------
    def walk(self, tokens: Sequence[int], limit: int | None = None) -> tuple[N, int]:
        """``(node, rel)`` where the longest stored prefix of ``tokens[:limit]`` ends; marks
        the path as used now.  ``rel`` is 0 only at the root."""
        limit = len(tokens) if limit is None else limit
        with self.lock:
            node, rel, pos = self.root, 0, 0
            tick = next(self._tick)
            node.last_used = tick
            while pos < limit:
                tok = tokens[pos]
                if rel < len(node.tokens) and node.tokens[rel] == tok:
                    rel += 1
                    pos += 1
                    continue
                nxt = node.child(rel, tok)
                if nxt is None:
                    break
                node, rel = nxt, 0
                node.last_used = tick
            if node in self._evictable:               # only the last node can be a leaf
                self._push(node)
            return node, rel

    def handle(self, node: N, rel: int) -> PinnedPrefix:
        """A pinned handle on the first ``node.start + rel`` tokens of ``node``'s path."""
        return self.handle_type(self, node, rel)

    def match(self, tokens: Sequence[int], limit: int | None = None) -> PinnedPrefix:
        """A handle on the longest stored prefix of ``tokens[:limit]``."""
        with self.lock:
            return self.handle(*self.walk(tokens, limit))

    # -- linking ------------------------------------------------------------------------------
    def attach(self, node: N) -> N:
        """Link a new ``node`` (built with its parent and offset) below its parent.

        Its first token must not start another child at the same offset, and it must hang
        where a walk can reach it: inside or at the end of the parent's tokens, past the first
        (a walk enters a node on its first token).  Marked as used now.
        """
        parent = node.parent
        with self.lock:
            self._check_new(node, scratch=False)
            group = parent.children.setdefault(node.offset, {})
            if node.tokens[0] in group:
                raise ValueError(f"{parent!r} already has a child at offset {node.offset} "
                                 f"starting with token {node.tokens[0]}")
            group[node.tokens[0]] = node
            self._evictable.discard(parent)
            node.last_used = next(self._tick)
            self.size += node.weight
            self.count += 1
            self._evictable.add(node)
            self._push(node)
            return node

    def scratch(self, node: N) -> PinnedPrefix:
        """Hang a new ``node`` (built with its parent and offset) off its parent as scratch,
        unreachable by any walk; a handle on all of it.

        The parent may be any node of the tree or a live scratch node (what continues scratch
        is scratch).  The node pins its parent until it is removed, which happens as soon as
        no handle pins it (``release(node)`` is called then).
        """
        with self.lock:
            self._check_new(node, scratch=True)
            node.scratch = True
            self._pin(node.parent, +1)
            self.scratch_count += 1
            self.scratch_size += node.weight
            return self.handle(node, len(node.tokens))

    def _check_new(self, node: N, *, scratch: bool) -> None:
        """Refuse (ValueError) a new node that cannot hang where it says; below a live scratch
        node only as ``scratch``."""
        parent = node.parent
        if parent is None or not node.tokens or node.pins:
            raise ValueError(f"cannot attach {node!r}: it needs a parent, tokens, no pins")
        if not (0 < node.offset or parent is self.root) or node.offset > len(parent.tokens):
            raise ValueError(f"cannot attach {node!r} at offset {node.offset} of {parent!r}")
        if not (self._linked(parent)
                or (scratch and parent.scratch and (parent.pins or parent.refs))):
            raise ValueError(f"cannot attach below {parent!r}: it is not in the tree")

    def _linked(self, node: N) -> bool:
        """Whether ``node`` is the root or linked from its parent (scratch nodes never are)."""
        parent = node.parent
        return node is self.root or (parent is not None and not node.scratch
                                     and parent.child(node.offset, node.tokens[0]) is node)

    @contextlib.contextmanager
    def freeze(self) -> Iterator[None]:
        """While open (re-entrant, any thread), ``frozen`` is positive: stores make scratch
        nodes instead of attaching."""
        with self.lock:
            self.frozen += 1
        try:
            yield
        finally:
            with self.lock:
                self.frozen -= 1

    def remove(self, node: N) -> None:
        """Unlink an evictable ``node`` (no hard pin, childless); its parent may become
        evictable.  A live node (soft references reach it) is kept as *lost* below its
        parent while they last; the engine drops its payload."""
        with self.lock:
            if node not in self._evictable:
                raise ValueError(f"{node!r} is pinned, has children or is not in the tree")
            parent = node.parent
            group = parent.children[node.offset]
            del group[node.tokens[0]]
            if not group:
                del parent.children[node.offset]
            self._evictable.discard(node)
            self.size -= node.weight
            self.count -= 1
            self.evictions += 1
            if node.refs:
                self.held -= node.weight
                self.live_evictions += 1
                self.lost_count += 1
                parent.lost.setdefault((node.offset, node.tokens[0]), []).append(node)
            self._maybe_evictable(parent)

    def lost_end(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """The position a walk of ``tokens[:limit]`` reaches through stored nodes and lost
        ones (evicted while live states referred to them): past the stored prefix, the
        tokens a prefill now computes again.  Does not count as a use.

        A lost path may leave a stored one anywhere, and a stored node may have replaced a
        lost one at the same place (a later prefill of the same tokens), so every node that
        spells the tokens so far is followed at once."""
        limit = len(tokens) if limit is None else limit
        with self.lock:
            frontier: dict[tuple[int, int], tuple[N, int]] = {(id(self.root), 0): (self.root, 0)}
            pos = 0
            while pos < limit:
                tok, reached = tokens[pos], {}
                for node, rel in frontier.values():
                    if rel < len(node.tokens) and node.tokens[rel] == tok:
                        reached[id(node), rel + 1] = (node, rel + 1)
                    stored = node.child(rel, tok)
                    for child in [*node.lost.get((rel, tok), ()), stored]:
                        if child is not None:
                            reached[id(child), 1] = (child, 1)
                if not reached:
                    break
                frontier, pos = reached, pos + 1
            return pos

    # -- pins and eviction order --------------------------------------------------------------
    def _pin(self, node: N, delta: int) -> None:
        """A hard pin on ``node`` taken (+1) or dropped (-1)."""
        with self.lock:
            before = node.pins
            node.pins += delta
            while node.scratch and node.pins == 0 and node.refs == 0:
                self.scratch_count -= 1               # its last handle went: so does it
                self.scratch_size -= node.weight
                if self.release is not None:
                    self.release(node)
                node = node.parent                    # and unpins its parent (a loop, not a
                before = node.pins                    # recursion: scratch chains grow long)
                node.pins -= 1
            if node.scratch:
                return
            if before == 0 and node.pins > 0:
                self._evictable.discard(node)
            elif before > 0 and node.pins == 0:
                self._maybe_evictable(node)

    def _forget(self, node: N) -> None:
        """A lost node no live state refers to any more leaves its parent's ``lost``."""
        key = (node.offset, node.tokens[0])
        group = node.parent.lost[key]
        group.remove(node)
        if not group:
            del node.parent.lost[key]
        self.lost_count -= 1

    def _ref(self, node: N, delta: int) -> None:
        """A soft reference on the path ending in ``node`` taken (+1) or dropped (-1)."""
        with self.lock:
            while node is not self.root:
                parent = node.parent
                node.refs += delta
                if node.refs == 0 and node.scratch and node.pins == 0:
                    self._pin(node, 0)                # its last handle went: so does it
                elif node.refs == (1 if delta > 0 else 0) and not node.scratch:
                    if self._linked(node):            # it became live, or stopped being
                        self.held += node.weight if delta > 0 else -node.weight
                    elif delta < 0:                   # lost, and no longer live: forgotten
                        self._forget(node)
                node = parent
            node.refs += delta

    def _maybe_evictable(self, node: N) -> None:
        if node.parent is not None and not node.children and node.pins == 0:
            self._evictable.add(node)
            self._push(node)

    def _push(self, node: N) -> None:
        heapq.heappush(self._lru, (node.last_used, next(self._order), node))
        if len(self._lru) > 2 * len(self._evictable) + 64:
            self._lru = [(n.last_used, next(self._order), n) for n in self._evictable]
            heapq.heapify(self._lru)

    def lru_leaf(self) -> N | None:
        """The least recently used evictable node, or None when every leaf is pinned."""
        with self.lock:
            while self._lru:
                used, _, node = entry = self._lru[0]
                if node in self._evictable and node.last_used == used:
                    return node
                if self._lru[0] is entry:         # else an unpin (a finalizer) pushed meanwhile
                    heapq.heappop(self._lru)
            return None

    # -- iteration and checking ---------------------------------------------------------------
    def nodes(self) -> Iterator[N]:
        """Every node but the root (depth first; take ``lock`` while iterating)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            for group in node.children.values():
                stack.extend(group.values())

    def verify(self, check: Callable[[N], None] | None = None) -> None:
        """Check links, positions, pins, accounting and the evictable set; then ``check(node)``
        (the payload's own checks) on every node but the root.  Raises RuntimeError."""
        with self.lock:
            if self.root.parent is not None or self.root.tokens or self.root in self._evictable:
                raise RuntimeError(f"corrupt root {self.root!r}")
            size = held = count = 0
            evictable = set()
            for node in self.nodes():
                self._verify_links(node)
                count += 1
                size += node.weight
                held += node.weight if node.refs else 0
                if not node.children and not node.pins:
                    evictable.add(node)
                if check is not None:
                    check(node)
            self._verify_refs()
            if (size, held, count) != (self.size, self.held, self.count):
                raise RuntimeError(f"accounting drift: the tree has {size} / {held} held / {count} "
                                   f"nodes, counters say {self.size} / {self.held} / {self.count}")
            if evictable != self._evictable:
                raise RuntimeError(f"evictable set drift: {len(evictable)} unpinned leaves, set "
                                   f"holds {len(self._evictable)}")
            current = {id(n) for used, _, n in self._lru if n.last_used == used}
            if any(id(n) not in current for n in evictable):
                raise RuntimeError("an evictable node has no current entry in the LRU order")

    def _verify_refs(self) -> None:
        """A soft reference counts on every node of its path: a node has at least the
        references of its children, linked or lost; a lost node is live and unlinked."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            lost = [c for group in node.lost.values() for c in group]
            below = [c for g in node.children.values() for c in g.values()] + lost
            if node.refs < sum(c.refs for c in below):
                raise RuntimeError(f"{node!r} has fewer references than its children")
            if any(not c.refs or self._linked(c) or c.parent is not node for c in lost):
                raise RuntimeError(f"a lost node below {node!r} is linked, or not live")
            stack.extend(below)

    def _verify_links(self, node: N) -> None:
        parent = node.parent
        if node.pins < 0 or node.refs < 0 or not node.tokens:
            raise RuntimeError(f"corrupt node {node!r}")
        if not (0 < node.offset or parent is self.root) or node.offset > len(parent.tokens):
            raise RuntimeError(f"node {node!r} hangs outside its parent {parent!r}")
        if node.start != parent.start + node.offset:
            raise RuntimeError(f"node {node!r} starts at {node.start}, its parent says "
                               f"{parent.start + node.offset}")
        if parent.child(node.offset, node.tokens[0]) is not node:
            raise RuntimeError(f"node {node!r} is not linked from its parent")
