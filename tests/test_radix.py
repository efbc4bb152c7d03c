"""The radix tree under every engine's store (`seqstate.radix`), with no model.

A Hypothesis state machine inserts, matches, pins, refers (soft handles, as states hold),
unpins and evicts at random and checks the tree against a plain model: the set of stored token
prefixes, the live handles and a log of when each prefix was last walked.  After every step
`verify()` holds, every hard-pinned prefix is still stored, `match` finds the longest stored
prefix, the leaf offered for eviction is the least recently used childless node no hard pin
holds (soft references do not protect it), live KV is accounted as the nodes soft handles
reach, and every evicted node a soft handle reaches counts as a live eviction.
"""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from seqstate.backends.hf.store import KVStore
from seqstate.radix import Node, PinnedPrefix, RadixTree

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=8).map(tuple)


def insert(tree: RadixTree, tokens: tuple[int, ...]) -> PinnedPrefix:
    """Store ``tokens`` as a store does: walk, then attach whatever is missing."""
    node, rel = tree.walk(tokens)
    if node.start + rel < len(tokens):
        node = tree.attach(Node(node, rel, tokens[node.start + rel:]))
        rel = len(node.tokens)
    return tree.handle(node, rel)


def tokens_to(node: Node, length: int) -> tuple[int, ...]:
    """The first ``length`` tokens of the path ending in ``node``."""
    out: list[int] = []
    hi = length - node.start
    while node.parent is not None:
        out[:0] = node.tokens[:hi]
        hi, node = node.offset, node.parent
    return tuple(out)


class Tree(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tree = RadixTree(Node(None, 0, ()))
        self.stored = {()}                    # every stored token prefix
        self.handles: list[tuple[PinnedPrefix, tuple[int, ...]]] = []   # with the tokens named
        self.soft: list[tuple[PinnedPrefix, tuple[int, ...]]] = []      # states' references
        self.live_evictions = 0
        self.scratch: list[tuple[PinnedPrefix, tuple[int, ...]]] = []   # handles on scratch nodes
        self.walks: list[tuple[int, tuple[int, ...]]] = []               # (tick, prefix walked)
        self.tick = 0

    def walked(self, prefix):
        self.tick += 1
        self.walks.append((self.tick, tuple(prefix)))

    def longest(self, tokens):
        return max(k for k in range(len(tokens) + 1) if tokens[:k] in self.stored)

    def recency(self, node):
        """When a walk last reached ``node``: the latest walk through its first token."""
        first = tokens_to(node, node.start + 1)
        return max(t for t, p in self.walks if p[:len(first)] == first)

    def live_scratch(self):
        """Every scratch node a live handle reaches (its own node, then scratch ancestors)."""
        live = {}
        for h, _ in self.scratch + self.soft:
            node = h.node
            while node.scratch:
                live[id(node)] = node
                node = node.parent
        return list(live.values())

    def pinned(self):
        """Stored nodes pinned by a handle or by a scratch child hanging off them."""
        nodes = {id(h.node): h.node for h, _ in self.handles}
        nodes.update((id(n.parent), n.parent) for n in self.live_scratch()
                     if not n.parent.scratch)
        return nodes

    def evictable(self):
        pinned = self.pinned()
        return [n for n in self.tree.nodes() if not n.children and id(n) not in pinned]

    def live(self):
        """Nodes on the path of a soft handle (linked or not)."""
        nodes = {}
        for h, _ in self.soft:
            node = h.node
            while node.parent is not None:
                nodes[id(node)] = node
                node = node.parent
        return nodes

    # -- operations ---------------------------------------------------------------------------
    @rule(rows=st.lists(st.tuples(TOKENS, st.booleans()), min_size=1, max_size=4))
    def insert(self, rows):
        for tokens, keep in rows:
            h = insert(self.tree, tokens)
            assert h.length == len(tokens)
            self.stored.update(tokens[:k] for k in range(len(tokens) + 1))
            self.walked(tokens)
            if keep:
                self.handles.append((h, tokens))

    @rule(rows=st.lists(st.tuples(TOKENS, st.booleans()), min_size=1, max_size=4))
    def match(self, rows):
        for tokens, keep in rows:
            h = self.tree.match(tokens)
            assert h.length == self.longest(tokens)      # the longest stored prefix
            self.walked(tokens[:h.length])
            if keep:
                self.handles.append((h, tokens[:h.length]))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def prefix(self, data):
        h, tokens = self.handles[data.draw(st.integers(0, len(self.handles) - 1))]
        n = data.draw(st.integers(0, len(tokens)))
        p = h.prefix(n)
        assert p.length == n and tokens_to(p.node, n) == tokens[:n]
        self.handles.append((p, tokens[:n]))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def unpin(self, data):
        del self.handles[data.draw(st.integers(0, len(self.handles) - 1))]

    @precondition(lambda self: self.handles or self.scratch)
    @rule(data=st.data())
    def refer(self, data):
        """A state keeps a soft handle on a pinned prefix (stored or scratch)."""
        pool = self.handles + self.scratch
        h, tokens = pool[data.draw(st.integers(0, len(pool) - 1))]
        soft = h.soft()
        assert not soft.hard and soft.length == h.length and soft.stored
        self.soft.append((soft, tokens))

    @precondition(lambda self: self.soft)
    @rule(data=st.data())
    def soft_prefix_or_drop(self, data):
        i = data.draw(st.integers(0, len(self.soft) - 1))
        if data.draw(st.booleans()):
            h, tokens = self.soft[i]
            n = data.draw(st.integers(0, len(tokens)))
            p = h.prefix(n)
            assert not p.hard and p.length == n and tokens_to(p.node, n) == tokens[:n]
            self.soft.append((p, tokens[:n]))
        else:
            del self.soft[i]

    @rule(data=st.data(), extra=TOKENS)
    def hang_scratch(self, data, extra):
        """A scratch node below a live handle (stored or scratch), or below the root."""
        bases = self.handles + self.scratch
        k = data.draw(st.integers(-1, len(bases) - 1))
        h, tokens = bases[k] if k >= 0 else (self.tree.match(()), ())
        s = self.tree.scratch(Node(h.node, h.rel, extra))
        assert s.node.scratch and s.length == len(tokens) + len(extra)
        self.scratch.append((s, tokens + extra))

    @precondition(lambda self: self.scratch)
    @rule(data=st.data())
    def scratch_prefix_or_unpin(self, data):
        i = data.draw(st.integers(0, len(self.scratch) - 1))
        if data.draw(st.booleans()):
            h, tokens = self.scratch[i]
            n = data.draw(st.integers(0, len(tokens)))
            p = h.prefix(n)
            assert p.length == n and tokens_to(p.node, n) == tokens[:n]
            (self.scratch if p.node.scratch else self.handles).append((p, tokens[:n]))
        else:
            del self.scratch[i]

    @rule(n=st.integers(1, 3))
    def evict(self, n):
        for _ in range(n):
            leaf = self.tree.lru_leaf()
            candidates = self.evictable()
            if leaf is None:
                assert not candidates
                return
            assert any(c is leaf for c in candidates)
            assert self.recency(leaf) == min(map(self.recency, candidates))   # LRU
            gone = {tokens_to(leaf, k) for k in range(leaf.start + 1, leaf.end + 1)}
            self.live_evictions += id(leaf) in self.live()
            self.tree.remove(leaf)
            self.stored -= gone

    @rule()
    def clear(self):
        while (leaf := self.tree.lru_leaf()) is not None:
            self.stored -= {tokens_to(leaf, k) for k in range(leaf.start + 1, leaf.end + 1)}
            self.live_evictions += id(leaf) in self.live()
            self.tree.remove(leaf)
        assert not self.evictable()

    # -- what always holds --------------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.tree.verify()
        assert self.tree.size == len(self.stored) - 1       # one token per stored prefix
        linked = {id(n) for n in self.tree.nodes()}
        assert self.tree.held == sum(len(n.tokens) for n in self.live().values()
                                     if id(n) in linked)    # live KV: what soft handles reach
        assert self.tree.live_evictions == self.live_evictions
        live = self.live_scratch()                          # scratch goes with its last pin
        assert self.tree.scratch_count == len(live)
        assert self.tree.scratch_size == sum(len(n.tokens) for n in live)
        assert not any(n.scratch for n in self.tree.nodes())

    @invariant()
    def pinned_prefixes_stay(self):
        for h, tokens in self.handles:
            assert tokens in self.stored
            assert h.length == len(tokens) and tokens_to(h.node, h.length) == tokens
        for h, tokens in self.soft:                         # stored, or lost and known so
            linked = {id(n) for n in self.tree.nodes()} | {id(self.tree.root)}
            assert h.stored == (h.node.scratch or id(h.node) in linked)
            if h.stored and not h.node.scratch:
                assert tokens in self.stored
            elif not h.node.scratch:                        # evicted: its tokens still known
                assert self.tree.lost_end(tokens) == len(tokens)
            assert tokens_to(h.node, h.length) == tokens
        for h, tokens in self.scratch:                      # readable, never matched
            assert tokens_to(h.node, h.length) == tokens
            assert self.tree.match(tokens).length == self.longest(tokens)
            self.walked(tokens[:self.longest(tokens)])


TestTree = Tree.TestCase
TestTree.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- focused cases ----------------------------------------------------------------------------
def test_eviction_is_lru_and_never_scans():
    tree = RadixTree(Node(None, 0, ()))
    leaves = [tree.attach(Node(tree.root, 0, (i, i))) for i in range(200)]
    for _ in range(5):                        # many touches: stale heap entries pile up
        for i in reversed(range(200)):
            tree.match((i, i))
    tree.verify()
    order = []
    while (leaf := tree.lru_leaf()) is not None:
        order.append(leaf)
        tree.remove(leaf)
        tree.verify()
    assert order == leaves[::-1]              # least recently matched first
    assert tree.count == tree.size == 0 and tree.evictions == 200


def test_a_parent_becomes_evictable_when_its_last_child_goes():
    tree = RadixTree(Node(None, 0, ()))
    parent = insert(tree, (1, 2, 3)).node
    child = insert(tree, (1, 2, 3, 4)).node
    assert tree.lru_leaf() is child and child.parent is parent
    tree.remove(child)
    assert tree.lru_leaf() is parent
    tree.remove(parent)
    assert tree.lru_leaf() is None
    tree.verify()


def test_a_pin_anywhere_in_a_node_keeps_it_and_its_ancestors():
    tree = RadixTree(Node(None, 0, ()))
    insert(tree, (1, 2, 3))
    h = insert(tree, (1, 2, 3, 4, 5)).prefix(4)
    assert tree.lru_leaf() is None            # the pinned leaf's parent has a child
    with pytest.raises(ValueError):
        tree.remove(h.node)
    del h
    assert tree.lru_leaf() is not None
    tree.verify()


def test_attach_refuses_what_a_walk_could_not_reach():
    tree = RadixTree(Node(None, 0, ()))
    a = tree.attach(Node(tree.root, 0, (1, 2)))
    with pytest.raises(ValueError):
        tree.attach(Node(tree.root, 0, (1, 5)))           # a second child starting with 1
    with pytest.raises(ValueError):
        tree.attach(Node(a, 3, (7,)))                     # past the parent's end
    with pytest.raises(ValueError):
        tree.attach(Node(a, 0, (7,)))                     # before the parent's first token
    tree.attach(Node(a, 1, (7,)))
    assert tree.match((1, 7, 9)).length == 2
    tree.verify()


def test_verify_catches_drift():
    tree = RadixTree(Node(None, 0, ()))
    insert(tree, (1, 2))
    tree.size += 1
    with pytest.raises(RuntimeError, match="accounting"):
        tree.verify()


def test_hf_store_accounts_bytes_and_evicts_lru_under_budget():
    layers, heads, dim = 2, 1, 4
    per_token = layers * 2 * heads * dim * 4

    def kv(n):
        return torch.randn(layers, 2, heads, n, dim)

    store = KVStore()
    base = store.extend((1, 2, 3, 4), 0, kv(4))      # a hard pin: work in progress
    state = base.soft()                              # and a state's reference: live KV
    for t in range(5, 9):                     # four 2-token leaves after the pinned base
        store.extend((1, 2, 3, 4, t, t), 4, kv(2))
    store.match((1, 2, 3, 4, 5, 5))           # 5 5 used most recently
    assert store.bytes_cached == 12 * per_token and store.evictions == 0
    store.budget_bytes = 9 * per_token
    store.extend((1, 2, 3, 4, 9), 4, kv(1))  # over budget: the two least recently used go
    assert store.evictions == 2 and store.bytes_cached == 9 * per_token
    assert [store.match((1, 2, 3, 4, t, t)).length for t in range(5, 9)] == [6, 4, 4, 6]
    assert store.bytes_held == 4 * per_token and store.segments == 4
    store.verify()
    assert store.clear() == 5 * per_token and store.bytes_cached == 4 * per_token
    assert [(s.tokens, lo, hi) for s, lo, hi in base.prefix(3).pieces()] == [((1, 2, 3, 4), 0, 3)]
    store.verify()
    del base                                  # the state's reference alone does not keep it
    assert store.clear() == 4 * per_token and not state.stored and store.live_evictions == 1
    assert store.bytes_held == 0 and store.match((1, 2, 3, 4)).length == 0
    store.verify()


def test_scratch_nodes_are_never_matched_and_go_with_their_last_pin():
    released = []
    tree = RadixTree(Node(None, 0, ()), release=released.append)
    stored = insert(tree, (1, 2, 3))
    a = tree.scratch(Node(stored.node, 2, (7, 8)))          # 1 2 7 8: below a stored node
    b = tree.scratch(Node(a.node, 2, (9,)))                 # 1 2 7 8 9: below a scratch one
    assert tree.match((1, 2, 7, 8, 9)).length == 2          # no walk enters scratch
    assert (tree.count, tree.size, tree.scratch_count, tree.scratch_size) == (1, 3, 2, 3)
    with pytest.raises(ValueError):
        tree.attach(Node(a.node, 1, (5,)))                  # nothing stored below scratch
    del stored
    assert tree.lru_leaf() is None                          # the scratch child pins it
    inner = a.node
    del a
    assert tree.scratch_count == 2 and not released         # b still pins its parent
    del b
    assert tree.scratch_count == 0 and tree.scratch_size == 0
    assert [n.tokens for n in released] == [(9,), (7, 8)] and inner in released
    assert tree.lru_leaf() is not None and tree.held == 0
    tree.verify()
    with pytest.raises(ValueError):
        tree.scratch(Node(inner, 1, (4,)))                  # a released scratch node is gone
