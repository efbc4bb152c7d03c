"""A token-level radix store over llama.cpp sequences (the llama.cpp engine's KV store).

With a *unified* KV cache every cell of llama.cpp's cache carries a set of sequence ids, and
``seq_cp`` only adds an id to cells (no data is copied).  The store keeps a radix tree of token
spans, as `seqstate.kv.store` does for torch segments: a `Node` hangs off its parent
after ``offset`` of the parent's tokens.  Its KV is not held in Python but in cells tagged with
llama.cpp sequence ids, the *carriers*:

- every node without a child hanging at its very end has exactly one carrier, a sequence whose
  cells are exactly the path root -> node end (positions ``[0, node.end)``);
- a node with a child at its end has none: that child's subtree carries it.

So every stored token sits in cells tagged by every carrier whose path goes through it, and a
prefix shared by eight stored rows occupies its cells once.  Sequence ids are a small pool
(``n_seq_max``) shared between carriers and the engine's working rows, which borrow ids with
`SeqStore.acquire()` and hand them back with `SeqStore.release()` or `SeqStore.insert()`.

Handles (`SeqHandle`) pin a node like `seqstate.kv.store.KVHandle` pins a segment.
Unpinned leaves are evicted least-recently-used when sequence ids or cells run out; evicting a
leaf hands its carrier, cut back, to a parent that would otherwise lose its last carrier, so a
pinned handle's tokens always stay in some carrier.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from seqstate.backends.base import CacheFullError
from seqstate.kv.handle import PinnedPrefix

__all__ = ["Memory", "Node", "SeqHandle", "SeqStore"]


class Memory(Protocol):
    """The llama.cpp memory operations the store needs (positions ``[p0, p1)``, -1 = open).

    ``seq_rm`` untags cells; the engine keeps cells it frees occupied until it compacts the
    cache (see `seqstate.backends.llamacpp.native`), which the store never sees.
    """

    def seq_rm(self, seq: int, p0: int, p1: int) -> None: ...

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...

    def seq_pos_min(self, seq: int) -> int: ...

    def seq_pos_max(self, seq: int) -> int: ...


class Node:
    """A span of stored tokens; its KV lives in llama.cpp cells tagged by carrier sequences."""

    __slots__ = ("__weakref__", "carrier", "children", "last_used", "offset", "parent", "pins",
                 "start", "tokens")

    def __init__(self, parent: Node | None, offset: int, tokens: tuple[int, ...]) -> None:
        self.parent = parent
        self.offset = offset                          # parent tokens that precede this node
        self.start = 0 if parent is None else parent.start + offset
        self.tokens = tokens
        self.children: dict[int, dict[int, Node]] = {}   # offset -> first token -> child
        self.carrier: int | None = None               # seq holding exactly [0, end), if any
        self.pins = 0
        self.last_used = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def end_child(self) -> Node | None:
        """A child hanging at this node's end (its subtree carries this node), if any."""
        group = self.children.get(len(self.tokens))
        return next(iter(group.values())) if group else None

    def __repr__(self) -> str:
        return (f"Node(start={self.start}, len={len(self.tokens)}, carrier={self.carrier}, "
                f"pins={self.pins})")


class SeqHandle(PinnedPrefix):
    """A pinned reference to the KV of the first ``length`` tokens of a stored path.

    While the handle is alive its node (and so every ancestor) stays in the store.  Handles are
    immutable and shared freely between states.
    """

    __slots__ = ()


class SeqStore:
    """The radix tree, the pool of sequence ids and the LRU eviction of unpinned leaves.

    Parameters
    ----------
    memory : Memory
        The llama.cpp memory the carriers live in.
    seq_ids : iterable of int
        The sequence ids this store may use (for carriers and for the rows it lends out).
    overflow_hint : str
        Appended to `ContextOverflowError` messages: what to enlarge.

    Examples
    --------
    Every llama.cpp model has one, as ``model.store``:

    >>> import seqstate as ss
    >>> model = ss.models.default(engine="llama.cpp", n_ctx=1024, n_threads=1)
    >>> state = ss.text(model)("Hello there", max_tokens=3)
    >>> ids = state.token_ids[0][0]
    >>> model.store.match(ids).length >= len(ids) - 1     # every token but the last is stored
    True
    >>> model.store.verify()
    """

    def __init__(self, memory: Memory, seq_ids: Iterable[int], overflow_hint: str = "") -> None:
        self.memory = memory
        self.overflow_hint = overflow_hint
        self.root = Node(None, 0, ())
        self.lock = threading.RLock()
        self.evictions = 0
        self._all = frozenset(seq_ids)
        self._free = sorted(self._all, reverse=True)  # a stack: freed ids are reused first
        self._lent: set[int] = set()
        self._carriers: dict[int, Node] = {}
        self._orphans: collections.deque[int] = collections.deque()
        self._tick = itertools.count(1)
        self._cells = 0
        self._held = 0
        self._nodes = 0

    # -- accounting ---------------------------------------------------------------------------
    @property
    def cells(self) -> int:
        """Cells of every stored token (each shared prefix counted once)."""
        return self._cells

    @property
    def held_cells(self) -> int:
        """Cells of nodes pinned by a live handle (as the HF store counts pinned segments)."""
        return self._held

    @property
    def num_nodes(self) -> int:
        return self._nodes

    @property
    def free_seqs(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Sequence ids this store manages (carriers and lent rows together)."""
        return len(self._all)

    def _pin(self, node: Node, delta: int) -> None:
        with self.lock:
            if (node.pins == 0) != (node.pins + delta == 0):
                self._held += len(node.tokens) if delta > 0 else -len(node.tokens)
            node.pins += delta

    # -- sequence ids -------------------------------------------------------------------------
    def acquire(self) -> int:
        """An empty sequence id lent to the caller, evicting unpinned carriers if none is free."""
        with self.lock:
            self._drain_orphans()
            while not self._free:
                if not self.evict_one():
                    raise CacheFullError(
                        f"every llama.cpp sequence id ({len(self._all)} usable) is held by a live "
                        f"state or working row ({len(self._carriers)} stored paths, "
                        f"{len(self._lent)} rows); drop states you no longer need, run fewer rows "
                        f"at once, or {self.overflow_hint}")
            seq = self._free.pop()
            self._lent.add(seq)
            return seq

    def release(self, seq: int) -> None:
        """Give back a lent sequence id; its cells are untagged (shared cells stay)."""
        with self.lock:
            if seq not in self._lent:
                raise RuntimeError(f"sequence {seq} is not lent out")
            self._lent.discard(seq)
            self._drop(seq)

    def _drop(self, seq: int) -> None:
        self.memory.seq_rm(seq, -1, -1)
        self._free.append(seq)

    def release_later(self, seqs: Sequence[int]) -> None:
        """Queue lent ids for release at the next store operation (safe from a finalizer,
        which may run in another thread while llama.cpp is decoding)."""
        self._orphans.extend(seqs)

    def _drain_orphans(self) -> None:
        while self._orphans:
            self.release(self._orphans.popleft())

    def lent(self) -> frozenset[int]:
        return frozenset(self._lent)

    # -- lookup -------------------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int], limit: int) -> tuple[Node, int]:
        node, rel, pos = self.root, 0, 0
        tick = next(self._tick)
        node.last_used = tick
        while pos < limit:
            tok = tokens[pos]
            if rel < len(node.tokens) and node.tokens[rel] == tok:
                rel += 1
                pos += 1
                continue
            nxt = node.children.get(rel, {}).get(tok)
            if nxt is None:
                break
            node, rel = nxt, 0
            node.last_used = tick
        return node, rel

    def match(self, tokens: Sequence[int], limit: int | None = None) -> SeqHandle:
        """A handle on the longest prefix of ``tokens[:limit]`` whose KV is stored."""
        with self.lock:
            node, rel = self._walk(tokens, len(tokens) if limit is None else limit)
            return SeqHandle(self, node, rel)

    def carrier(self, node: Node) -> int:
        """A sequence whose cells hold the whole path root -> ``node``'s end."""
        while node.carrier is None:
            child = node.end_child()
            if child is None:
                raise RuntimeError(f"{node!r} has no carrier and no child at its end")
            node = child
        return node.carrier

    def load(self, handle: SeqHandle, seq: int) -> None:
        """Tag the handle's cells with the (empty) sequence ``seq``: a fork, no data copied."""
        with self.lock:
            if handle.length:
                self.memory.seq_cp(self.carrier(handle.node), seq, 0, handle.length)

    # -- insertion ----------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], n: int, seq: int) -> SeqHandle:
        """Store ``tokens[:n]``, whose KV the lent sequence ``seq`` holds at positions ``[0, n)``.

        ``seq`` goes back to the store: it becomes the carrier of the new node, or is released
        when every token was stored already.  Tokens already stored are relinked to the stored
        cells, so each prefix occupies its cells once.  Returns a handle on ``n`` tokens.
        """
        with self.lock:
            if seq not in self._lent:
                raise RuntimeError(f"sequence {seq} is not lent out")
            node, rel = self._walk(tokens, n)
            m = node.start + rel
            if m == n:
                handle = SeqHandle(self, node, rel)
                self.release(seq)
                return handle
            if m:
                # drop this row's own copy of the stored prefix and share the stored cells
                self.memory.seq_rm(seq, 0, m)
                self.memory.seq_cp(self.carrier(node), seq, 0, m)
            child = Node(node, rel, tuple(tokens[m:n]))
            child.last_used = next(self._tick)
            node.children.setdefault(rel, {})[child.tokens[0]] = child
            self._lent.discard(seq)
            self._set_carrier(child, seq)
            if node.carrier is not None and rel == len(node.tokens):
                # the child's carrier now holds the node's whole path: the old one is redundant
                old = node.carrier
                self._set_carrier(node, None)
                self._drop(old)
            self._cells += len(child.tokens)
            self._nodes += 1
            return SeqHandle(self, child, len(child.tokens))

    def _set_carrier(self, node: Node, seq: int | None) -> None:
        if node.carrier is not None:
            del self._carriers[node.carrier]
        node.carrier = seq
        if seq is not None:
            self._carriers[seq] = node

    # -- eviction -----------------------------------------------------------------------------
    def _nodes_iter(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            for group in node.children.values():
                stack.extend(group.values())

    def evict_one(self) -> bool:
        """Drop the least recently used unpinned leaf; False when every leaf is pinned."""
        with self.lock:
            leaves = [n for n in self._nodes_iter()
                      if n.parent is not None and not n.children and n.pins == 0]
            if not leaves:
                return False
            leaf = min(leaves, key=lambda n: n.last_used)
            parent = leaf.parent
            group = parent.children[leaf.offset]
            del group[leaf.tokens[0]]
            if not group:
                del parent.children[leaf.offset]
            seq = leaf.carrier
            self._set_carrier(leaf, None)
            self._cells -= len(leaf.tokens)
            self._nodes -= 1
            self.evictions += 1
            if parent is not self.root and parent.carrier is None and parent.end_child() is None:
                # the leaf hung at the parent's end and was its last carrier: cut it back to it
                self.memory.seq_rm(seq, parent.end, -1)
                self._set_carrier(parent, seq)
            else:
                self._drop(seq)
            return True

    def clear(self) -> int:
        """Evict every unpinned leaf (repeatedly); returns how many nodes were dropped."""
        dropped = 0
        while self.evict_one():
            dropped += 1
        return dropped

    # -- checking -----------------------------------------------------------------------------
    def verify(self) -> None:
        """Check the tree, the id pool and every carrier against llama.cpp's own positions.

        Raises RuntimeError on any drift.
        """
        with self.lock:
            self._drain_orphans()
            cells = held = count = 0
            for node in self._nodes_iter():
                if node.parent is None:
                    continue
                count += 1
                cells += len(node.tokens)
                held += len(node.tokens) if node.pins > 0 else 0
                self._verify_node(node)
            if (cells, held, count) != (self._cells, self._held, self._nodes):
                raise RuntimeError(f"accounting drift: tree has {cells} cells / {held} held / "
                                   f"{count} nodes, counters say {self._cells} / {self._held} / "
                                   f"{self._nodes}")
            ids = [*self._free, *self._lent, *self._carriers]
            if len(ids) != len(set(ids)) or set(ids) != self._all:
                raise RuntimeError(f"sequence id pool drift: free {sorted(self._free)}, lent "
                                   f"{sorted(self._lent)}, carriers {sorted(self._carriers)}")
            for seq in self._free:
                if self.memory.seq_pos_max(seq) != -1:
                    raise RuntimeError(f"free sequence {seq} still holds cells")

    def _verify_node(self, node: Node) -> None:
        parent = node.parent
        if node.pins < 0 or not node.tokens:
            raise RuntimeError(f"corrupt node {node!r}")
        if not 0 < node.offset <= len(parent.tokens) and parent is not self.root:
            raise RuntimeError(f"node {node!r} hangs outside its parent")
        if parent.children.get(node.offset, {}).get(node.tokens[0]) is not node:
            raise RuntimeError(f"node {node!r} is not linked from its parent")
        if node.carrier is None:
            if node.end_child() is None:
                raise RuntimeError(f"node {node!r} has neither a carrier nor a child at its end")
            return
        if self._carriers.get(node.carrier) is not node:
            raise RuntimeError(f"carrier map disagrees for {node!r}")
        lo = self.memory.seq_pos_min(node.carrier)
        hi = self.memory.seq_pos_max(node.carrier)
        if (lo, hi) != (0, node.end - 1):
            raise RuntimeError(f"carrier {node.carrier} of {node!r} holds positions [{lo}, {hi}] "
                               f"in llama.cpp, expected [0, {node.end - 1}]")
