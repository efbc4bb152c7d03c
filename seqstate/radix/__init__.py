"""One token radix tree under every engine's KV store; each engine keeps only its payload.

A `Node` is a span of tokens that hangs off its parent after ``offset`` of the parent's
tokens (children are keyed by that offset, then by their first token), so a path from the
root spells a stored token prefix and a prefix shared by many rows is stored once.  Engines
subclass `Node` with their payload (the HF engine: a KV tensor segment; llama.cpp: the
sequence id that carries the path) and override `Node.weight`, the amount the tree accounts
per node (bytes, cells).

`RadixTree` owns what every store needs: the longest-prefix walk, handles (`PinnedPrefix`),
linking and unlinking nodes with their accounting, and an incremental set of *evictable*
nodes (childless, not the root, no hard pin) kept in least-recently-used order, so choosing
what to evict is a heap pop, never a scan of the tree.  What to evict and when (a byte
budget, no free sequence ids) stays with the engine.

A handle is one of two kinds.  A *hard* pin is work in progress (a prefill, a working row
borrowing stored KV): its node cannot be evicted.  A *soft* reference is what a live state
holds: the KV is a cache, not a lease, so a referenced node is evicted like any other under
pressure, least recently used first, and the state's tokens are computed again when it is
next continued.  Soft references count on every node of their path (``refs``), which is what
makes KV *live*: `RadixTree.live_evictions` counts live nodes evicted, and an evicted live
node stays reachable as *lost* from its parent until its last reference goes, so a prefill
can tell which of the tokens it computes are computed again (`RadixTree.lost_end`).

*Scratch* nodes hold KV that must never be matched: what was computed while a
``frozen_store()`` block was open (activation hooks may have edited it), and anything below
such a node.  `RadixTree.scratch` hangs one off a parent without linking it into the
parent's children, so no walk reaches it and no store count includes it; it pins its parent
while it lives and is removed the moment its last pin goes, never joining the LRU order.

Examples
--------
>>> tree = RadixTree(Node(None, 0, ()))
>>> a = tree.attach(Node(tree.root, 0, (1, 2, 3)))
>>> tree.match([1, 2, 3, 4]).length     # the longest stored prefix
3
>>> kept = tree.match([1, 2])            # a hard pin: work in progress
>>> tree.lru_leaf() is None
True
>>> del kept
>>> tree.lru_leaf() is a
True
>>> state = tree.match([1, 2]).soft()   # a state's reference: evictable
>>> tree.lru_leaf() is a, tree.held
(True, 3)
>>> tree.remove(a)
>>> tree.live_evictions, tree.lost_end([1, 2, 3, 4])    # lost: computed again
(1, 3)
>>> del state
>>> tree.lost_end([1, 2, 3, 4])
0
>>> tree.verify()

A scratch node is reachable only through its handle, and goes with it:

>>> a = tree.attach(Node(tree.root, 0, (1, 2, 3)))
>>> h = tree.scratch(Node(a, 3, (4, 5)))
>>> h.length, tree.match([1, 2, 3, 4, 5]).length, tree.scratch_count
(5, 3, 1)
>>> del h
>>> tree.scratch_count
0
"""

from seqstate.radix.node import Node, PinnedPrefix
from seqstate.radix.store import RadixStore
from seqstate.radix.tree import RadixTree

__all__ = ["Node", "PinnedPrefix", "RadixTree", "RadixStore"]
