"""`RadixStore`: what every engine's KV store on the tree shares (see `seqstate.radix`)."""

from __future__ import annotations

import contextlib

from seqstate.radix.tree import RadixTree

__all__ = ["RadixStore"]


class RadixStore:
    """What every engine's store on the tree shares: ``tree``, its ``lock``, the freeze behind
    ``model.frozen_store()``, and the KV counters every engine reports, in bytes.

    Parameters
    ----------
    tree : RadixTree
        The tree of the engine's nodes.
    bytes_per_weight : int, default 1
        Bytes of KV per unit of a node's `Node.weight`: 1 where nodes weigh their bytes (the
        HF engine), the bytes of one KV cell where they weigh their cells (llama.cpp).
    """

    def __init__(self, tree: RadixTree, bytes_per_weight: int = 1) -> None:
        self.tree = tree
        self.lock = tree.lock
        self.bytes_per_weight = bytes_per_weight

    # -- counters -----------------------------------------------------------------------------
    @property
    def bytes_cached(self) -> int:
        """Bytes of every stored node's KV, held or not (all of it evictable)."""
        return self.tree.size * self.bytes_per_weight

    @property
    def bytes_held(self) -> int:
        """Bytes of stored KV that live states refer to (evictable all the same)."""
        return self.tree.held * self.bytes_per_weight

    @property
    def bytes_scratch(self) -> int:
        """Bytes of live scratch nodes (pinned by states made inside ``frozen_store()``)."""
        return self.tree.scratch_size * self.bytes_per_weight

    @property
    def segments(self) -> int:
        """Stored nodes (segments of KV), the root aside."""
        return self.tree.count

    @property
    def evictions(self) -> int:
        """Nodes evicted so far."""
        return self.tree.evictions

    @property
    def live_evictions(self) -> int:
        """Evicted nodes that live states referred to (computed again when continued)."""
        return self.tree.live_evictions

    def kv_stats(self) -> dict[str, int]:
        """The counters, one consistent snapshot, under the names of the model's
        `seqstate.models.base.Stats` (which say ``kv_`` where the store needs not)."""
        with self.lock:
            return {"kv_bytes_held": self.bytes_held, "kv_bytes_cached": self.bytes_cached,
                    "evictions": self.evictions, "live_evictions": self.live_evictions,
                    "segments": self.segments}

    # -- freezing -----------------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        """Whether a ``frozen_store()`` block is open: what is computed now is scratch."""
        return self.tree.frozen > 0

    def freeze(self) -> contextlib.AbstractContextManager[None]:
        """A block (re-entrant, any thread) during which nothing is stored: see
        ``model.frozen_store()``."""
        return self.tree.freeze()
