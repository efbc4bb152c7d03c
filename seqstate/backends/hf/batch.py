"""The HF engine's working rows: a decode buffer written in place, with a 2-D mask of holes."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from seqstate.backends.base import Fed
from seqstate.backends.hf.buffer import KVBuffer
from seqstate.backends.hf.cache import Cache, as_cache
from seqstate.backends.hf.prefill import Network, ensure_kv
from seqstate.backends.hf.store import KVHandle

__all__ = ["HFBatch"]


class HFBatch:
    """Rows' KV side by side in one `KVBuffer`, each row's prefix right-aligned.

    Every forward takes one buffer column for all buffer rows.  A row not fed (finished,
    waiting, or released) rides along; that column is junk and is masked out if the row is
    fed again.  A rollback masks the dropped columns out (holes); columns that every live
    row dropped (the buffer's last) are given back instead, written again by the next forward
    (`_reclaim`).  Nothing is ever recomputed and no other row is touched.  Rows joining
    later are right-aligned to the current column
    (the buffer shifts right when a newcomer's prefix is longer); released rows and columns
    no live row uses are compacted away once they are a quarter of the buffer.

    KV fed while the store is frozen (``model.frozen_store()``) is committed as scratch: each
    row remembers its first such column.

    A row's stored prefix is copied into the buffer when it joins, so the store may evict it
    while the row runs (a row keeps only a soft handle on it, its ``base``): `commit` then
    stores the row's whole KV again from the buffer.
    """

    def __init__(self, backend: Network) -> None:
        self.backend = backend
        self.buf: KVBuffer | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)       # (rows, capacity)
        self.row_of: dict[int, int] = {}     # slot id -> buffer row
        self.bases: list[KVHandle] = []      # per buffer row: stored KV of its prefix (soft)
        self.cols: list[list[int]] = []      # per buffer row: columns of its KV past the base
        self.junk: list[list[int]] = []      # per buffer row: columns of steps it sat out
        self.first: list[int] = []           # per buffer row: its first KV column
        self.frozen: list[int | None] = []   # per buffer row: its first col fed while frozen
        self.padded = False                  # False while no row needs a mask
        self._dropped = False                # a truncate since the last forward: see _reclaim
        self._next_slot = 0
        self._cache: tuple[torch.Tensor, Cache] | None = None  # the buffer's, on its memory

    # -- joining and leaving ------------------------------------------------------------------
    def add(self, rows: Sequence[Sequence[int]], grow_by: int) -> list[int]:
        slots = self._join(ensure_kv(self.backend, rows), grow_by)
        self.backend.store.evict()                # the prefill's pins went: its KV is copied
        return slots

    def _join(self, handles: list[KVHandle], grow_by: int) -> list[int]:
        """New buffer rows holding each handle's KV (soft handles kept as their bases)."""
        need = max(h.length for h in handles)
        b = self.backend
        if self.buf is None:
            self.buf = KVBuffer(b.num_layers, b.kv_heads, b.head_dim, len(handles), need + grow_by,
                                b.dtype, b.device)
            self.buf.length = need
            self.mask = torch.zeros(len(handles), self.buf.capacity, dtype=torch.long)
            self.padded = len({h.length for h in handles}) > 1
        else:
            if need > self.buf.length:
                self._shift(need - self.buf.length)
            self._grow(len(handles), self.buf.length + grow_by)
            self.padded = True
        end = self.buf.length
        slots = []
        for h in handles:
            row = len(self.bases)
            self.buf.load(row, h, end)
            self.mask[row, end - h.length: end] = 1
            self.bases.append(h.soft())
            self.cols.append([])
            self.junk.append([])
            self.first.append(end - h.length)
            self.frozen.append(None)
            slots.append(self._new_slot(row))
        return slots

    def _new_slot(self, row: int) -> int:
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.row_of[slot] = row
        return slot

    def fork(self, slot: int) -> int:
        row = self.row_of[slot]
        self._grow(1, self.buf.capacity)
        new = len(self.bases)
        self.buf.data[:, :, new] = self.buf.data[:, :, row]
        self.mask[new] = self.mask[row]
        self.bases.append(self.bases[row])
        self.cols.append(list(self.cols[row]))
        self.junk.append(list(self.junk[row]))
        self.first.append(self.first[row])
        self.frozen.append(self.frozen[row])
        return self._new_slot(new)

    def release(self, slot: int) -> None:
        del self.row_of[slot]
        if not self.row_of:
            self.close()
        elif (len(self.bases) - len(self.row_of)) * 4 >= len(self.bases):
            self._compact()

    def close(self) -> None:
        self.buf, self._cache = None, None    # the buffer is freed; stored KV stays
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self._dropped = False
        self.row_of.clear()
        self.bases, self.cols, self.junk, self.first, self.frozen = [], [], [], [], []

    # -- the buffer's shape -------------------------------------------------------------------
    def _grow(self, rows: int, capacity: int) -> None:
        """Room for ``rows`` more buffer rows and ``capacity`` columns."""
        self.buf.ensure(capacity)
        self.buf.add_rows(rows)
        shape = (self.buf.rows, self.buf.capacity)
        grown = self.mask.new_zeros(shape)
        grown[: self.mask.shape[0], : self.mask.shape[1]] = self.mask
        self.mask = grown

    def _shift(self, delta: int) -> None:
        """Move every column right by ``delta`` (a newcomer's prefix is longer than the past)."""
        self.buf.shift(delta)
        grown = self.mask.new_zeros(self.buf.rows, self.buf.capacity)
        grown[:, delta: delta + self.mask.shape[1]] = self.mask[:, : self.buf.capacity - delta]
        self.mask = grown
        self.cols = [[c + delta for c in cs] for cs in self.cols]
        self.junk = [[c + delta for c in cs] for cs in self.junk]
        self.first = [f + delta for f in self.first]

    def _compact(self) -> None:
        """Drop released rows, and leading columns no live row uses (a copy, amortised)."""
        keep = sorted(self.row_of.values())
        index = torch.tensor(keep, dtype=torch.long)
        self.buf.keep_rows(index)
        self.mask = self.mask.index_select(0, index)
        renumber = {old: new for new, old in enumerate(keep)}
        self.row_of = {s: renumber[r] for s, r in self.row_of.items()}
        self.bases = [self.bases[r] for r in keep]
        self.cols = [self.cols[r] for r in keep]
        self.junk = [self.junk[r] for r in keep]
        self.first = [self.first[r] for r in keep]
        self.frozen = [self.frozen[r] for r in keep]
        lo = min(self.first)
        if lo * 4 >= self.buf.capacity:
            self.buf.shift(-lo)
            self.mask = torch.cat([self.mask[:, lo:], self.mask.new_zeros(len(keep), lo)], 1)
            self.cols = [[c - lo for c in cs] for cs in self.cols]
            self.junk = [[c - lo for c in cs] for cs in self.junk]
            self.first = [f - lo for f in self.first]

    # -- the protocol -------------------------------------------------------------------------
    def length(self, slot: int) -> int:
        row = self.row_of[slot]
        return self.bases[row].length + len(self.cols[row])

    def forward(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        fed = {self.row_of[s]: [t] for s, t in zip(slots, tokens)}
        logits = self._feed(fed, 1, "last")                                              # (B, V)
        rows = list(fed)
        if rows == list(range(logits.shape[0])):        # every buffer row, in order: no copy
            return logits
        return logits[rows]                                                             # (N, V)

    def extend(self, slots: Sequence[int], feeds: Sequence[Sequence[int]]) -> Fed:
        fed = {self.row_of[s]: list(f) for s, f in zip(slots, feeds)}
        logits = self._feed(fed, max(map(len, feeds)), "fed")                # (N, V), by row
        at, n = {}, 0
        for r in sorted(fed):
            at[r], n = n, n + len(fed[r])
        return Fed(logits, tuple(at[self.row_of[s]] for s in slots), tuple(map(len, feeds)))

    def _feed(self, fed: dict[int, list[int]], k: int, which: str) -> torch.Tensor:
        """One forward of ``k`` new columns: buffer row ``r`` gets ``fed[r]`` then junk;
        rows not fed ride along on junk (their output is dropped; a finished row needs no
        mask).  Junk columns come after a row's fed tokens, so causal attention never sees
        them; they are masked out when the row is fed again.  Logits (B, V) of every row's
        last column (``which="last"``), or (N, V) of the fed columns only, row by row
        (``"fed"``: the LM head, most of a small model's forward, skips the junk)."""
        if self._dropped:
            self._reclaim()
        buf, backend = self.buf, self.backend
        if buf.length + k > buf.capacity:
            self._grow(0, buf.length + k)
        col = buf.length
        for r in fed:
            if self.junk[r]:                      # a row fed again forgets the steps it sat out
                self.mask[r, self.junk[r]] = 0
                self.junk[r].clear()
                self.padded = True
        pad, device = backend.pad_token_id, buf.data.device
        rows = range(buf.rows)
        starts = [self.bases[r].length + len(self.cols[r]) for r in rows]
        # where every row's next position is its column (rows of one length, no holes), the
        # model's own positions (the cache's length on) are these: none are fed
        own = which == "last" and all(s == col for s in starts)
        # each row's tokens, their positions and (for "fed") which of them give logits: one
        # (1 to 3, B, k) tensor made from a flat array (torch reads nested lists element by
        # element), one copy to the device
        flat = array("q")
        for r in rows:
            flat.extend((fed.get(r, []) + [pad] * k)[:k])
        if not own:
            for start in starts:
                flat.extend(range(start, start + k))
        if which == "fed":
            for n in (len(fed.get(r, ())) for r in rows):
                flat.extend([1] * n + [0] * (k - n))
        inputs = torch.frombuffer(flat, dtype=torch.int64)
        if device.type != "cpu":
            inputs = inputs.to(device)
        if own:
            ids, pos, keep = inputs.view(buf.rows, k), None, []
        else:
            ids, pos, *keep = inputs.view(-1, buf.rows, k)
        # every row's new columns are attended to; the mask goes to the model only where a
        # row needs one
        self.mask[:, col: col + k] = 1
        step_mask = self.mask[:, : col + k].to(device) if self.padded else None
        if backend.store.frozen:              # before the forward: what it computes is scratch
            for r in fed:
                if self.frozen[r] is None:
                    self.frozen[r] = len(self.cols[r])
        if self._cache is None or self._cache[0] is not buf.data:
            # a new Cache where the buffer's memory moved (grown, compacted): the old one's
            # views would keep the old memory until the next forward
            self._cache = (buf.data, as_cache(buf))
        logits = backend.forward(ids, step_mask, pos, self._cache[1],
                                 logits=True if which == "last" else keep[0].bool())
        buf.length += k
        for r in range(buf.rows):
            n = len(fed.get(r, ()))
            self.cols[r].extend(range(col, col + n))
            self.junk[r].extend(range(col + n, col + k))
        backend.counters["decode_tokens"] += sum(map(len, fed.values()))
        return logits

    def truncate(self, slot: int, length: int) -> None:
        row = self.row_of[slot]
        keep = length - self.bases[row].length
        self.mask[row, self.cols[row][keep:]] = 0
        del self.cols[row][keep:]
        if self.frozen[row] is not None and self.frozen[row] >= keep:
            self.frozen[row] = None
        self.padded = self._dropped = True

    def _reclaim(self) -> None:
        """Give back the buffer's last columns where no live row uses them (a rejected draft
        or a rollback at the end of every row): the next forward writes there again, and
        where no live row has a hole below them, the forwards go on without a mask (a masked
        forward costs more than one without).  Holes below stay masked."""
        self._dropped = False
        rows = list(self.row_of.values())
        top = max(self.cols[r][-1] + 1 if self.cols[r] else self.first[r] + self.bases[r].length
                  for r in rows)
        if top >= self.buf.length:
            return
        self.buf.length = top
        self.junk = [[c for c in cs if c < top] for cs in self.junk]
        self.padded = not bool(self.mask[rows, :top].all())        # the live rows' (host) mask

    def commit(self, slot: int, tokens: Sequence[int], length: int) -> KVHandle:
        """Store the slot's KV of ``tokens[:length]``: what the store lacks of it, copied
        from the buffer (the prefix too, if it was evicted meanwhile).  A soft handle."""
        row = self.row_of[slot]
        base = self.bases[row]
        frozen = self.frozen[row]
        store = self.backend.store
        # what was fed while frozen is scratch: stored KV of the same tokens must not stand in
        scratch = frozen is not None and frozen < length - base.length
        with store.lock:
            if base.node.scratch:                 # a scratch path goes on below its handle
                found = base
            else:                                 # a hard pin while the rest is stored
                found = store.match(tokens, base.length + frozen if scratch else length)
            if found.length >= length:
                return found.prefix(length).soft()
            columns = [*range(self.first[row], self.first[row] + base.length), *self.cols[row]]
            kv = self.buf.gather(row, columns[found.length: length])
            return store.extend(tokens, found.length, kv, base=found, scratch=scratch).soft()
