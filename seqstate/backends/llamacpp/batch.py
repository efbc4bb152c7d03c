"""The llama.cpp engine's working rows: slots over llama.cpp sequences."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from seqstate.backends.base import Fed
from seqstate.backends.llamacpp.store import SeqHandle, SeqStore
from seqstate.errors import ContextOverflowError

__all__ = ["LlamaCppBatch", "Engine"]


class Engine(Protocol):
    """What a batch uses of its backend (`seqstate.backends.llamacpp.backend.LlamaCppBackend`,
    whose methods document these)."""

    store: SeqStore
    llama: Any            # the native context: seq_cp, seq_rm, seq_pos_min, seq_pos_max
    n_ctx: int

    def guarded(self) -> AbstractContextManager[None]: ...

    def ensure_kv(self, rows: Sequence[Sequence[int]], grow_by: int) -> list[SeqHandle]: ...

    def fork(self, handles: Sequence[SeqHandle]) -> list[int]: ...

    def evaluate(self, tokens: list[int], positions: list[int], seqs: list[int],
                 outputs: list[bool]) -> torch.Tensor | None: ...

    def count(self, **deltas: int) -> None: ...


def _orphan(store: SeqStore, slots: dict[int, _Slot]) -> None:
    """Finalizer of an unclosed batch: its sequences go back at the store's next operation."""
    store.release_later([s.seq for s in slots.values() if s.seq is not None])


def _scratch_from(handle: SeqHandle) -> int | None:
    """The first position of ``handle``'s path that is scratch, or None."""
    node, first = handle.node, None
    while node.scratch:
        first, node = node.start, node.parent
    return first


class _Slot:
    """A working row: its own sequence, or (``seq`` None) a borrowed stored handle (a hard
    pin: the store keeps that path while the slot borrows it).
    ``scratch``: its first position whose KV is scratch (computed inside ``frozen_store()``,
    or below a scratch handle), if any."""

    __slots__ = ("base", "length", "scratch", "seq")

    def __init__(self, seq: int | None, base: SeqHandle | None, length: int,
                 scratch: int | None) -> None:
        self.seq, self.base, self.length, self.scratch = seq, base, length, scratch


class LlamaCppBatch:
    """Working rows ("slots") over llama.cpp sequences (see ``base.Batch``).

    A slot either owns a sequence or *borrows* a stored handle: rows join borrowing the
    stored KV of their prefix and get a sequence of their own (a fork: cells are shared, not
    copied) on their first forward or truncation.  `commit()` of a slot's whole KV hands
    its sequence to the store and leaves the slot borrowing the stored path, so a finished row
    costs no sequence id, and a later fork of it costs none either until it is fed.
    """

    def __init__(self, backend: Engine) -> None:
        self._backend = backend
        self._store = backend.store
        self._llama = backend.llama
        self._slots: dict[int, _Slot] = {}
        self._next_id = 0
        weakref.finalize(self, _orphan, self._store, self._slots)

    def _slot(self, slot: int) -> _Slot:
        try:
            return self._slots[slot]
        except KeyError:
            raise KeyError(f"slot {slot} is not in this batch (released, or never added)") from None

    def _new(self, seq: int | None, base: SeqHandle | None, length: int,
             scratch: int | None = None) -> int:
        slot, self._next_id = self._next_id, self._next_id + 1
        self._slots[slot] = _Slot(seq, base, length, scratch)
        return slot

    def _own(self, s: _Slot) -> int:
        """The slot's own sequence, forking it from the borrowed handle first if needed."""
        if s.seq is None:
            [s.seq], s.base = self._backend.fork([s.base]), None
        return s.seq

    def add(self, rows: Sequence[Sequence[int]], grow_by: int) -> list[int]:
        """New slots holding each ``row[:-1]``'s KV, computing only uncached tails."""
        with self._backend.guarded():
            handles = self._backend.ensure_kv(rows, grow_by)
            return [self._new(None, h, h.length, _scratch_from(h)) for h in handles]

    def forward(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens[j]`` to ``slots[j]`` in one ``llama_decode``; logits (len(slots), V)."""
        return self.extend(slots, [[t] for t in tokens]).logits

    def extend(self, slots: Sequence[int], feeds: Sequence[Sequence[int]]) -> Fed:
        """Feed ``feeds[j]`` to ``slots[j]`` in one ``llama_decode`` (chunks of ``n_batch``);
        logits ``(len(feeds[j]), V)`` per slot, in slot order."""
        with self._backend.guarded():
            if len(slots) != len(feeds) or len(set(slots)) != len(slots) \
                    or not all(len(f) for f in feeds):
                raise ValueError(f"expected distinct slots and tokens for each, got slots "
                                 f"{list(slots)} and {len(feeds)} feeds")
            rows = [self._slot(s) for s in slots]
            n_ctx = self._backend.n_ctx
            for slot, s, f in zip(slots, rows, feeds):
                if s.length + len(f) > n_ctx:
                    raise ContextOverflowError(
                        f"slot {slot} holds {s.length} tokens and {len(f)} more do not fit the "
                        f"llama.cpp context's n_ctx={n_ctx}; create the backend with a larger "
                        "n_ctx")
            seqs = [self._own(s) for s in rows]
            if self._store.frozen:            # before the decode: what it computes is scratch
                for s in rows:
                    s.scratch = s.length if s.scratch is None else s.scratch
            tokens = [t for f in feeds for t in f]
            positions = [s.length + j for s, f in zip(rows, feeds) for j in range(len(f))]
            owners = [seq for seq, f in zip(seqs, feeds) for _ in f]
            logits = self._backend.evaluate(tokens, positions, owners, [True] * len(tokens))
            for s, f in zip(rows, feeds):
                s.length += len(f)
            self._backend.count(decode_tokens=len(tokens))
            lengths = tuple(map(len, feeds))
            return Fed(logits, tuple(itertools.accumulate(lengths, initial=0))[:-1], lengths)

    def length(self, slot: int) -> int:
        return self._slot(slot).length

    def truncate(self, slot: int, length: int) -> None:
        """Forget the slot's KV past ``length`` tokens (``seq_rm``; shared cells stay)."""
        with self._backend.guarded():
            s = self._slot(slot)
            if not 0 <= length <= s.length:
                raise ValueError(f"cannot truncate slot {slot} of {s.length} tokens to {length}")
            if s.seq is None:
                s.base = s.base.prefix(length)
            else:
                self._llama.seq_rm(s.seq, length, -1)
            s.length = length
            if s.scratch is not None and s.scratch >= length:
                s.scratch = None

    def fork(self, slot: int) -> int:
        """A new slot continuing ``slot``: the same cells, tagged with one more sequence."""
        with self._backend.guarded():
            s = self._slot(slot)
            if s.seq is None:
                return self._new(None, s.base, s.length, s.scratch)
            seq = self._store.acquire()
            self._llama.seq_cp(s.seq, seq, -1, -1)
            return self._new(seq, None, s.length, s.scratch)

    def release(self, slot: int) -> None:
        """Drop the slot; its own sequence goes back (cells other sequences tag stay)."""
        with self._backend.guarded():
            s = self._slots.pop(slot, None)
            if s is not None and s.seq is not None:
                self._store.release(s.seq)

    def commit(self, slot: int, tokens: Sequence[int], length: int) -> SeqHandle:
        """Store the slot's KV of ``tokens[:length]``; returns a soft handle on it (a state's:
        the store may evict it once the slot no longer borrows it)."""
        with self._backend.guarded():
            return self._commit(slot, tokens, length).soft()

    def _commit(self, slot: int, tokens: Sequence[int], length: int) -> SeqHandle:
        s = self._slot(slot)
        if not 0 <= length <= s.length:
            raise ValueError(f"slot {slot} holds {s.length} tokens, cannot commit {length}")
        scratch = s.scratch is not None and s.scratch < length
        if s.seq is None and scratch:
            return s.base.prefix(length)                    # a scratch path: borrowed
        found = self._store.match(tokens, length)
        if found.length == length:
            if s.seq is not None and length == s.length:
                # stored already (another row computed it): share those cells instead
                self._store.release(s.seq)
                s.seq, s.base = None, found
            return found
        if s.seq is None:
            raise RuntimeError(f"slot {slot} holds the stored KV of other tokens than "
                               f"those committed")
        if length == s.length:
            # the slot's sequence becomes the carrier; the slot borrows the stored path
            handle = self._store.insert(tokens, length, s.seq, scratch=scratch)
            s.seq, s.base = None, handle
            return handle
        copy = self._store.acquire()
        self._llama.seq_cp(s.seq, copy, 0, length)
        return self._store.insert(tokens, length, copy, scratch=scratch)

    def close(self) -> None:
        """Release every slot; committed KV stays in the store."""
        with self._backend.guarded():
            for slot in list(self._slots):
                self.release(slot)

    def owned(self) -> set[int]:
        """The sequences this batch's slots own."""
        return {s.seq for s in self._slots.values() if s.seq is not None}

    def verify(self) -> None:
        """Check every owned sequence against llama.cpp's positions; RuntimeError on drift."""
        for slot, s in self._slots.items():
            if s.seq is None:
                continue
            got = (self._llama.seq_pos_min(s.seq), self._llama.seq_pos_max(s.seq))
            if got != ((0, s.length - 1) if s.length else (-1, -1)):
                raise RuntimeError(f"slot {slot} (seq {s.seq}) should hold {s.length} tokens, "
                                   f"llama.cpp has positions {list(got)}")

