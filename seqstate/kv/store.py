"""A token-level radix tree of immutable KV segments, one per model.

A `Segment` holds the keys and values of a span of tokens for every layer, as one tensor
``(layers, 2, kv_heads, n, head_dim)``, and hangs off its parent after ``offset`` of the parent's
tokens.  A `KVHandle` names a prefix of the path from the root to a segment; states hold
handles, so slicing back is a handle to an earlier position (a view) and forking shares one.

Any token sequence is matched against the tree, so a prefix computed for one state is reused by
every other state, including ones built from plain strings.  Segments pinned by a live handle are
never evicted; the others stay as a cache, dropped least-recently-used (leaves first) when the
store is over its byte budget.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from seqstate.kv.handle import PinnedPrefix

__all__ = ["Segment", "KVHandle", "KVStore", "DEFAULT_BUDGET_BYTES"]

DEFAULT_BUDGET_BYTES = 1 << 30


class Segment:
    """An immutable span of KV.  Never written after creation."""

    __slots__ = ("parent", "offset", "start", "tokens", "kv", "children", "pins", "last_used",
                 "__weakref__")

    def __init__(self, parent: Segment | None, offset: int, tokens: tuple[int, ...],
                 kv: torch.Tensor | None) -> None:
        self.parent = parent
        self.offset = offset                          # parent tokens that precede this segment
        self.start = 0 if parent is None else parent.start + offset
        self.tokens = tokens
        self.kv = kv                                  # (layers, 2, kv_heads, len, head_dim)
        self.children: dict[int, dict[int, Segment]] = {}   # offset -> first token -> child
        self.pins = 0
        self.last_used = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def child(self, offset: int, token: int) -> Segment | None:
        return self.children.get(offset, {}).get(token)

    def __repr__(self) -> str:
        return f"Segment(start={self.start}, len={len(self.tokens)}, pins={self.pins})"


class KVHandle(PinnedPrefix):
    """A pinned reference to the KV of the first ``length`` tokens of a path in the store.

    While the handle is alive its segment (and so, as it is not a leaf, every ancestor) cannot be
    evicted.  Handles are shared freely between states; they are never mutated.
    """

    __slots__ = ()

    @property
    def segment(self) -> Segment:
        """The segment the prefix ends in."""
        return self.node

    def pieces(self) -> list[tuple[Segment, int, int]]:
        """``(segment, lo, hi)`` spans, root first, whose KV concatenated is this handle's KV."""
        out, seg, hi = [], self.node, self.rel
        while seg is not None and seg.kv is not None:
            if hi > 0:
                out.append((seg, 0, hi))
            hi, seg = seg.offset, seg.parent
        out.reverse()
        return out

    def kv(self) -> torch.Tensor:
        """The KV as one tensor ``(layers, 2, kv_heads, length, head_dim)`` (a copy)."""
        parts = [seg.kv[:, :, :, lo:hi] for seg, lo, hi in self.pieces()]
        if not parts:
            return self.store.empty_kv()
        return torch.cat(parts, dim=3)


@dataclass(frozen=True, slots=True)
class Match:
    segment: Segment
    rel: int

    @property
    def length(self) -> int:
        return self.segment.start + self.rel


class KVStore:
    """The per-model radix store.  Thread-safe; every public method takes the store lock.

    Parameters
    ----------
    budget_bytes : int
        Unpinned segments are evicted (LRU, leaves first) while the store holds more than this.
    """

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.root = Segment(None, 0, (), None)
        self.lock = threading.RLock()
        self._tick = itertools.count(1)
        self._bytes = 0
        self._held = 0
        self._segments = 0
        self.evictions = 0
        self._layout: tuple[int, int, int, torch.dtype, torch.device] | None = None

    # -- accounting ---------------------------------------------------------------------------
    @property
    def bytes_cached(self) -> int:
        return self._bytes

    @property
    def bytes_held(self) -> int:
        return self._held

    @property
    def num_segments(self) -> int:
        return self._segments

    def empty_kv(self) -> torch.Tensor:
        layers, heads, dim, dtype, device = self._layout or (0, 0, 0, torch.float32, "cpu")
        return torch.empty(layers, 2, heads, 0, dim, dtype=dtype, device=device)

    def _pin(self, seg: Segment, delta: int) -> None:
        with self.lock:
            if (seg.pins == 0) != (seg.pins + delta == 0):
                self._held += seg.nbytes if delta > 0 else -seg.nbytes
            seg.pins += delta

    # -- lookup -------------------------------------------------------------------------------
    def root_handle(self) -> KVHandle:
        return KVHandle(self, self.root, 0)

    def _walk(self, tokens: Sequence[int], limit: int) -> Match:
        seg, rel, pos = self.root, 0, 0
        tick = next(self._tick)
        seg.last_used = tick
        while pos < limit:
            tok = tokens[pos]
            if rel < len(seg.tokens) and seg.tokens[rel] == tok:
                rel += 1
                pos += 1
                continue
            nxt = seg.child(rel, tok)
            if nxt is None:
                break
            seg, rel = nxt, 0
            seg.last_used = tick
        return Match(seg, rel)

    def match(self, tokens: Sequence[int], limit: int | None = None) -> KVHandle:
        """A handle on the longest prefix of ``tokens[:limit]`` whose KV is in the store."""
        with self.lock:
            m = self._walk(tokens, len(tokens) if limit is None else limit)
            return KVHandle(self, m.segment, m.rel)

    # -- insertion ----------------------------------------------------------------------------
    def extend(self, tokens: Sequence[int], start: int, kv: torch.Tensor) -> KVHandle:
        """Add the KV ``kv`` of ``tokens[start:start + n]``; ``tokens[:start]`` must be stored.

        Tokens already present (computed by another row) are kept as they are and the duplicate
        KV is dropped, so every prefix is stored once.  Returns a handle on ``start + n`` tokens.
        """
        n = kv.shape[3]
        end = start + n
        with self.lock:
            if self._layout is None:
                self._layout = (kv.shape[0], kv.shape[2], kv.shape[4], kv.dtype, kv.device)
            m = self._walk(tokens, end)
            if m.length < start:
                raise RuntimeError(f"KV for tokens[:{start}] is not stored (found {m.length})")
            seg, rel = m.segment, m.rel
            if m.length < end:
                skip = m.length - start
                part = kv[:, :, :, skip:] if skip else kv
                child = Segment(seg, rel, tuple(tokens[m.length:end]), part.contiguous()
                                if skip else part)
                child.last_used = next(self._tick)
                seg.children.setdefault(rel, {})[tokens[m.length]] = child
                self._bytes += child.nbytes
                self._segments += 1
                seg, rel = child, n - skip
            handle = KVHandle(self, seg, rel)
            self.evict()
            return handle

    # -- eviction -----------------------------------------------------------------------------
    def _segments_iter(self) -> Iterator[Segment]:
        stack = [self.root]
        while stack:
            seg = stack.pop()
            yield seg
            for group in seg.children.values():
                stack.extend(group.values())

    def evict(self, budget_bytes: int | None = None) -> int:
        """Drop unpinned leaf segments, least recently used first, until under the budget.

        Returns the number of bytes freed.  Pinned segments (and their ancestors) stay.
        """
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        freed = 0
        with self.lock:
            while self._bytes > budget:
                leaves = [s for s in self._segments_iter()
                          if s.parent is not None and not s.children and s.pins == 0]
                if not leaves:
                    break
                leaves.sort(key=lambda s: s.last_used)
                for leaf in leaves:
                    if self._bytes <= budget:
                        break
                    group = leaf.parent.children[leaf.offset]
                    del group[leaf.tokens[0]]
                    if not group:
                        del leaf.parent.children[leaf.offset]
                    self._bytes -= leaf.nbytes
                    freed += leaf.nbytes
                    self._segments -= 1
                    self.evictions += 1
        return freed

    def verify(self) -> None:
        """Check the tree against the byte/pin accounting; raises RuntimeError when inconsistent."""
        with self.lock:
            total = held = count = 0
            for seg in self._segments_iter():
                if seg.parent is None:
                    continue
                count += 1
                total += seg.nbytes
                held += seg.nbytes if seg.pins > 0 else 0
                if seg.pins < 0 or seg.kv is None or seg.kv.shape[3] != len(seg.tokens):
                    raise RuntimeError(f"corrupt segment {seg!r}")
                if not 0 <= seg.offset <= len(seg.parent.tokens):
                    raise RuntimeError(f"segment {seg!r} hangs outside its parent")
                if seg.parent.children.get(seg.offset, {}).get(seg.tokens[0]) is not seg:
                    raise RuntimeError(f"segment {seg!r} is not linked from its parent")
            if (total, held, count) != (self._bytes, self._held, self._segments):
                raise RuntimeError(f"accounting drift: tree has {total} B / {held} B held / {count} "
                                   f"segments, counters say {self._bytes} / {self._held} / {self._segments}")

    def clear(self) -> int:
        """Evict every unpinned segment."""
        return self.evict(0)
