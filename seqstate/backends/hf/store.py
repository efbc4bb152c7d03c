"""The HF engine's KV store: immutable torch KV segments on the shared radix tree.

A `Segment` is a `seqstate.radix.Node` whose payload is the keys and values of its tokens for
every layer, one tensor ``(layers, 2, kv_heads, n, head_dim)``, never written after creation.
A `KVHandle` names a prefix of the path from the root to a segment; states hold handles, so
slicing back is a handle to an earlier position (a view) and forking shares one.

Any token sequence is matched against the tree, so a prefix computed for one state is reused by
every other state, including ones built from plain strings.  Stored KV is a cache, not a lease:
while the store holds more bytes than its budget, the least recently used leaf segment is
dropped, whether a live state refers to it (a soft handle) or not; only segments hard-pinned by
work in progress (a prefill) stay.  A state whose KV went is computed again from its tokens
when it is next continued, exactly as the first time.

KV computed inside ``model.frozen_store()`` (`KVStore.frozen`) is kept in scratch segments:
its handles work, but no match finds it and it goes with its last handle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqstate.radix import Node, PinnedPrefix, RadixStore, RadixTree

__all__ = ["Segment", "KVHandle", "KVStore", "DEFAULT_BUDGET_BYTES"]

DEFAULT_BUDGET_BYTES = 1 << 30


class Segment(Node):
    """A span of stored tokens and their KV, accounted by its bytes."""

    __slots__ = ("kv",)

    def __init__(self, parent: Segment | None, offset: int, tokens: tuple[int, ...],
                 kv: torch.Tensor | None) -> None:
        super().__init__(parent, offset, tokens)
        self.kv = kv                                  # (layers, 2, kv_heads, len, head_dim)

    @property
    def weight(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


class KVHandle(PinnedPrefix):
    """A reference to the KV of the first ``length`` tokens of a path in the store.

    While a hard handle is alive its segment (and so, as it is not a leaf, every ancestor)
    cannot be evicted; a soft one (a state's) marks the path live but lets it go under the
    budget.  Handles are shared freely between states; they are never mutated.
    """

    __slots__ = ()

    def pieces(self) -> list[tuple[Segment, int, int]]:
        """``(segment, lo, hi)`` spans, root first, whose KV concatenated is this handle's KV."""
        out, seg, hi = [], self.node, self.rel
        while seg.parent is not None:
            if hi > 0:
                out.append((seg, 0, hi))
            hi, seg = seg.offset, seg.parent
        out.reverse()
        return out


class KVStore(RadixStore):
    """The per-model radix store.  Thread-safe; every public method takes the tree's lock.
    ``frozen`` while a ``frozen_store()`` block is open; the counters (``bytes_cached``,
    ``bytes_held``, ``evictions``, ...) and ``kv_stats()`` are `seqstate.radix.RadixStore`'s.

    Parameters
    ----------
    budget_bytes : int
        Segments are evicted (LRU, leaves first) while the store holds more than this; only
        those hard-pinned by work in progress stay.

    Examples
    --------
    >>> import torch
    >>> store = KVStore()
    >>> kv = torch.zeros(2, 2, 1, 3, 4)     # 2 layers, 1 KV head, 3 tokens
    >>> state = store.extend([5, 6, 7], 0, kv).soft()     # a state's handle
    >>> store.match([5, 6, 7, 8]).length, store.bytes_held == kv.numel() * 4
    (3, True)
    >>> store.clear() == kv.numel() * 4     # a cache, not a lease
    True
    >>> state.stored, store.live_evictions, store.bytes_held
    (False, 1, 0)
    """

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        super().__init__(RadixTree(Segment(None, 0, (), None), KVHandle))
        self.budget_bytes = budget_bytes

    # -- lookup and insertion -----------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> KVHandle:
        """A handle on the longest prefix of ``tokens[:limit]`` whose KV is in the store."""
        return self.tree.match(tokens, limit)

    def extend(self, tokens: Sequence[int], start: int, kv: torch.Tensor, *,
               base: KVHandle | None = None, scratch: bool = False) -> KVHandle:
        """Add the KV ``kv`` of ``tokens[start:start + n]``; ``tokens[:start]`` must be stored,
        or be ``base``'s.

        Tokens already present (computed by another row) are kept as they are and the duplicate
        KV is dropped, so every prefix is stored once.  Returns a handle on ``start + n`` tokens.
        The KV goes to a scratch segment below ``base`` instead (stored nowhere a match finds
        it) when ``scratch`` is set (it was computed inside ``frozen_store()``), when the store
        is frozen, or when ``base`` is scratch itself.
        """
        n = kv.shape[3]
        end = start + n
        with self.lock:
            if scratch or self.frozen or (base is not None and base.node.scratch):
                return self._scratch(tokens, start, kv, base)
            seg, rel = self.tree.walk(tokens, end)
            stored = seg.start + rel
            if stored < start:
                raise RuntimeError(f"KV for tokens[:{start}] is not stored (found {stored})")
            if stored < end:
                skip = stored - start
                part = kv[:, :, :, skip:].contiguous() if skip else kv
                seg = self.tree.attach(Segment(seg, rel, tuple(tokens[stored:end]), part))
                rel = n - skip
            handle = self.tree.handle(seg, rel)
            self.evict()
            return handle

    def _scratch(self, tokens: Sequence[int], start: int, kv: torch.Tensor,
                 base: KVHandle | None) -> KVHandle:
        base = self.tree.match(tokens, start) if base is None else base
        if base.length != start:
            raise RuntimeError(f"KV for tokens[:{start}] is not stored (found {base.length})")
        if kv.shape[3] == 0:
            return base
        span = tuple(tokens[start: start + kv.shape[3]])
        return self.tree.scratch(Segment(base.node, base.rel, span, kv))

    # -- eviction and checking ----------------------------------------------------------------
    def evict(self, budget_bytes: int | None = None) -> int:
        """Drop leaf segments, least recently used first, until under the budget, whether
        live states refer to them or not.

        Returns the number of bytes freed.  Hard-pinned segments (and their ancestors) stay.
        """
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        freed = 0
        with self.lock:
            while self.tree.size > budget:
                leaf = self.tree.lru_leaf()
                if leaf is None:
                    break
                freed += leaf.weight
                self.tree.remove(leaf)
                leaf.kv = None                        # a state's handle may outlive it
        return freed

    def clear(self) -> int:
        """Evict every segment no work in progress pins."""
        return self.evict(0)

    def verify(self) -> None:
        """Check the tree and the byte/pin accounting; raises RuntimeError when inconsistent."""
        self.tree.verify(_check_segment)


def _check_segment(seg: Segment) -> None:
    if seg.kv is None or seg.kv.shape[3] != len(seg.tokens):
        raise RuntimeError(f"segment {seg!r} has no KV for its {len(seg.tokens)} tokens")
