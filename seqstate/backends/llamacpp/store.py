"""A token-level radix store over llama.cpp sequences (the llama.cpp engine's KV store).

With a *unified* KV cache every cell of llama.cpp's cache carries a set of sequence ids, and
``seq_cp`` only adds an id to cells (no data is copied).  The store keeps its paths on the
radix tree every engine shares (`seqstate.radix`): a `SeqNode` hangs off its parent after
``offset`` of the parent's tokens.  Its KV is not held in Python but in cells tagged with
llama.cpp sequence ids, the *carriers*:

- every node without a child hanging at its very end has exactly one carrier, a sequence whose
  cells are exactly the path root -> node end (positions ``[0, node.end)``);
- a node with a child at its end has none: that child's subtree carries it.

So every stored token sits in cells tagged by every carrier whose path goes through it, and a
prefix shared by eight stored rows occupies its cells once.  Sequence ids are a small pool
(``n_seq_max``) shared between carriers and the engine's working rows, which borrow ids with
`SeqStore.acquire()` and hand them back with `SeqStore.release()` or `SeqStore.insert()`.

Handles (`SeqHandle`) refer to a node like `seqstate.backends.hf.store.KVHandle` refers to a
segment: a hard pin (a working row borrowing the stored path) keeps it, a live state's soft
handle does not.  Leaves no hard pin holds are evicted least-recently-used when sequence ids
or cells run out, whether states refer to them or not (a state whose path went is prefilled
again when continued); evicting a leaf hands its carrier, cut back, to a parent that would
otherwise lose its last carrier, so a hard-pinned handle's tokens always stay in some carrier.

Inside ``model.frozen_store()`` a row's path is inserted as a *scratch* node of the tree: its
own carrier holds its whole path, no match finds it, and its sequence (with its cells) goes
back to the pool once no handle pins it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Protocol

from seqstate.backends.base import CacheFullError
from seqstate.radix import Node, PinnedPrefix, RadixStore, RadixTree

__all__ = ["Memory", "SeqNode", "SeqHandle", "SeqStore"]


class Memory(Protocol):
    """The llama.cpp memory operations the store needs (positions ``[p0, p1)``, -1 = open).

    ``seq_rm`` untags cells; the engine keeps cells it frees occupied until it compacts the
    cache (see `seqstate.backends.llamacpp.native`), which the store never sees.
    """

    def seq_rm(self, seq: int, p0: int, p1: int) -> None: ...

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...

    def seq_pos_min(self, seq: int) -> int: ...

    def seq_pos_max(self, seq: int) -> int: ...

    def bytes_per_cell(self) -> int: ...


class SeqNode(Node):
    """A span of stored tokens; its KV lives in llama.cpp cells tagged by carrier sequences.
    Accounted by its cells (`Node.weight`: one per token)."""

    __slots__ = ("carrier",)

    def __init__(self, parent: SeqNode | None, offset: int, tokens: tuple[int, ...]) -> None:
        super().__init__(parent, offset, tokens)
        self.carrier: int | None = None               # seq holding exactly [0, end), if any

    def end_child(self) -> SeqNode | None:
        """A child hanging at this node's end (its subtree carries this node), if any."""
        group = self.children.get(len(self.tokens))
        return next(iter(group.values())) if group else None

    def __repr__(self) -> str:
        return (f"SeqNode(start={self.start}, len={len(self.tokens)}, carrier={self.carrier}, "
                f"pins={self.pins})")


class SeqHandle(PinnedPrefix):
    """A reference to the KV of the first ``length`` tokens of a stored path.

    While a hard handle is alive its node (and so every ancestor) stays in the store; a soft
    one (a state's) lets it go under pressure.  Handles are immutable and shared freely
    between states.
    """

    __slots__ = ()


class SeqStore(RadixStore):
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
    >>> # every token but the last is stored
    >>> model.store.match(ids).length >= len(ids) - 1
    True
    >>> model.store.verify()
    """

    def __init__(self, memory: Memory, seq_ids: Iterable[int], overflow_hint: str = "") -> None:
        self.memory = memory
        self.overflow_hint = overflow_hint
        super().__init__(RadixTree(SeqNode(None, 0, ()), SeqHandle, release=self._scratch_gone),
                         bytes_per_weight=memory.bytes_per_cell())
        self._all = frozenset(seq_ids)
        self._free = sorted(self._all, reverse=True)  # a stack: freed ids are reused first
        self._lent: set[int] = set()
        self._carriers: dict[int, SeqNode] = {}       # of stored nodes and live scratch ones
        self._orphans: collections.deque[int] = collections.deque()

    # -- accounting (the KV counters and kv_stats() are RadixStore's, in bytes) --------------
    @property
    def cells(self) -> int:
        """Cells of every stored token (each shared prefix counted once)."""
        return self.tree.size

    @property
    def free_seqs(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Sequence ids this store manages (carriers and lent rows together)."""
        return len(self._all)

    # -- sequence ids -------------------------------------------------------------------------
    def acquire(self) -> int:
        """An empty sequence id lent to the caller, evicting the least recently used stored
        paths if none is free."""
        with self.lock:
            self._drain_orphans()
            while not self._free:
                if not self.evict_one():
                    raise CacheFullError(
                        f"every llama.cpp sequence id ({len(self._all)} usable) is held by a "
                        f"working row or a stored path one needs ({len(self._carriers)} stored "
                        f"paths, {len(self._lent)} rows); run fewer rows at once, or "
                        f"{self.overflow_hint}")
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
    def match(self, tokens: Sequence[int], limit: int | None = None) -> SeqHandle:
        """A handle on the longest prefix of ``tokens[:limit]`` whose KV is stored."""
        return self.tree.match(tokens, limit)

    def carrier(self, node: SeqNode) -> int:
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
    def insert(self, tokens: Sequence[int], n: int, seq: int, *, scratch: bool = False
               ) -> SeqHandle:
        """Store ``tokens[:n]``, whose KV the lent sequence ``seq`` holds at positions ``[0, n)``.

        ``seq`` goes back to the store: it becomes the carrier of the new node, or is released
        when every token was stored already.  Tokens already stored are relinked to the stored
        cells, so each prefix occupies its cells once.  Returns a handle on ``n`` tokens.
        With ``scratch`` (KV computed inside ``frozen_store()``), or while the store is frozen,
        ``seq`` carries a scratch node instead, which no match finds and which goes (with its
        sequence) when its last handle does.
        """
        with self.lock:
            if seq not in self._lent:
                raise RuntimeError(f"sequence {seq} is not lent out")
            node, rel = self.tree.walk(tokens, n)
            m = node.start + rel
            if m == n:
                handle = self.tree.handle(node, rel)
                self.release(seq)
                return handle
            if scratch or self.frozen:
                return self._carry(self.tree.scratch, SeqNode(node, rel, tuple(tokens[m:n])), seq)
            if m:
                # drop this row's own copy of the stored prefix and share the stored cells
                self.memory.seq_rm(seq, 0, m)
                self.memory.seq_cp(self.carrier(node), seq, 0, m)
            handle = self._carry(self._attach, SeqNode(node, rel, tuple(tokens[m:n])), seq)
            if node.carrier is not None and rel == len(node.tokens):
                # the child's carrier now holds the node's whole path: the old one is redundant
                old = node.carrier
                self._set_carrier(node, None)
                self._drop(old)
            return handle

    def _attach(self, node: SeqNode) -> SeqHandle:
        return self.tree.handle(self.tree.attach(node), len(node.tokens))

    def _carry(self, link, node: SeqNode, seq: int) -> SeqHandle:
        """``link(node)`` (attach, or hang as scratch) with the lent ``seq`` as its carrier."""
        handle = link(node)
        self._lent.discard(seq)
        self._set_carrier(node, seq)
        return handle

    def _scratch_gone(self, node: SeqNode) -> None:
        # the tree calls this under the lock, maybe from a handle's finalizer while llama.cpp
        # decodes on another thread: the sequence is freed at the next store operation
        seq = node.carrier
        self._set_carrier(node, None)
        self._lent.add(seq)
        self._orphans.append(seq)

    def _set_carrier(self, node: SeqNode, seq: int | None) -> None:
        if node.carrier is not None:
            del self._carriers[node.carrier]
        node.carrier = seq
        if seq is not None:
            self._carriers[seq] = node

    # -- eviction -----------------------------------------------------------------------------
    def evict_one(self) -> bool:
        """Drop the least recently used leaf no hard pin holds (live states' included); False
        when every leaf is pinned by work in progress."""
        with self.lock:
            leaf = self.tree.lru_leaf()
            if leaf is None:
                return False
            parent = leaf.parent
            seq = leaf.carrier
            self._set_carrier(leaf, None)
            self.tree.remove(leaf)
            if parent is not self.tree.root and parent.carrier is None \
                    and parent.end_child() is None:
                # the leaf hung at the parent's end and was its last carrier: cut it back to it
                self.memory.seq_rm(seq, parent.end, -1)
                self._set_carrier(parent, seq)
            else:
                self._drop(seq)
            return True

    def clear(self) -> int:
        """Evict every leaf no hard pin holds (repeatedly); returns how many nodes were
        dropped."""
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
            self.tree.verify(self._verify_node)
            ids = [*self._free, *self._lent, *self._carriers]
            if len(ids) != len(set(ids)) or set(ids) != self._all:
                raise RuntimeError(f"sequence id pool drift: free {sorted(self._free)}, lent "
                                   f"{sorted(self._lent)}, carriers {sorted(self._carriers)}")
            for seq in self._free:
                if self.memory.seq_pos_max(seq) != -1:
                    raise RuntimeError(f"free sequence {seq} still holds cells")
            for node in self._carriers.values():
                if node.scratch:
                    self._verify_carrier(node)

    def _verify_node(self, node: SeqNode) -> None:
        if node.carrier is None:
            if node.end_child() is None:
                raise RuntimeError(f"node {node!r} has neither a carrier nor a child at its end")
            return
        self._verify_carrier(node)

    def _verify_carrier(self, node: SeqNode) -> None:
        if self._carriers.get(node.carrier) is not node:
            raise RuntimeError(f"carrier map disagrees for {node!r}")
        lo = self.memory.seq_pos_min(node.carrier)
        hi = self.memory.seq_pos_max(node.carrier)
        if (lo, hi) != (0, node.end - 1):
            raise RuntimeError(f"carrier {node.carrier} of {node!r} holds positions [{lo}, {hi}] "
                               f"in llama.cpp, expected [0, {node.end - 1}]")
