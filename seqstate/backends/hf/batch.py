"""The HF engine's working rows: a decode buffer written in place, with a 2-D mask of holes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqstate.kv.buffer import KVBuffer
from seqstate.kv.hf_cache import as_cache
from seqstate.kv.store import KVHandle

__all__ = ["HFBatch"]


class HFBatch:
    """Rows' KV side by side in one :class:`KVBuffer`, each row's stored prefix right-aligned.

    Every step takes one buffer column for all rows.  A row not fed this step (finished, or
    waiting) rides along and that column is junk, masked out if the row is fed again; a
    rollback masks the dropped columns out (holes).  Nothing is ever recomputed and no other
    row is touched.
    """

    def __init__(self, backend, handles: Sequence[KVHandle], extra: int) -> None:
        model = backend.model
        self.backend, self.model = backend, model
        past = max(h.length for h in handles)
        self.buf = KVBuffer(model.num_layers, model.kv_heads, model.head_dim, len(handles),
                            past + extra, model.dtype, model.device)
        self.mask = torch.zeros(len(handles), self.buf.capacity, dtype=torch.long)     # (B, C)
        for i, h in enumerate(handles):
            self.buf.load(i, h, past)
            self.mask[i, past - h.length: past] = 1
        self.buf.length = past
        self.bases = list(handles)                    # stored KV of each row's prefix (pinned)
        self.cols: list[list[int]] = [[] for _ in handles]   # buffer columns past the base
        self.junk: list[list[int]] = [[] for _ in handles]   # columns of steps a row sat out
        self.padded = len({h.length for h in handles}) > 1   # else no mask is needed
        self.cache = as_cache(self.buf)

    def length(self, slot: int) -> int:
        return self.bases[slot].length + len(self.cols[slot])

    def forward(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        buf, model = self.buf, self.model
        buf.ensure(buf.length + 1)
        if self.mask.shape[1] < buf.capacity:
            grow = self.mask.new_zeros(buf.rows, buf.capacity - self.mask.shape[1])
            self.mask = torch.cat([self.mask, grow], 1)
        col = buf.length
        fed = dict(zip(slots, tokens))
        for s in fed:
            if self.junk[s]:                      # a row fed again forgets the steps it sat out
                self.mask[s, self.junk[s]] = 0
                self.junk[s].clear()
                self.padded = True
        # rows not fed ride along (their output is dropped); a finished row never needs a mask
        ids = torch.tensor([[fed.get(s, model.pad_token_id)] for s in range(buf.rows)])   # (B, 1)
        pos = torch.tensor([[self.length(s)] for s in range(buf.rows)])                    # (B, 1)
        self.mask[:, col] = 1
        step_mask = self.mask[:, : col + 1].to(model.device) if self.padded else None
        logits = model.forward(ids.to(model.device), step_mask, pos.to(model.device), self.cache)
        buf.length += 1
        for s in range(buf.rows):
            (self.cols if s in fed else self.junk)[s].append(col)
        self.backend.count(decode_tokens=len(slots))
        return logits[list(slots)]                                                        # (N, V)

    def truncate(self, slot: int, length: int) -> None:
        keep = length - self.bases[slot].length
        self.mask[slot, self.cols[slot][keep:]] = 0
        del self.cols[slot][keep:]
        self.padded = True

    def reorder(self, parents: Sequence[int]) -> None:
        index = torch.tensor(list(parents), dtype=torch.long)
        self.buf.keep_rows(index)
        self.mask = self.mask.index_select(0, index)
        self.bases = [self.bases[p] for p in parents]
        self.cols = [list(self.cols[p]) for p in parents]
        self.junk = [list(self.junk[p]) for p in parents]

    def commit(self, slot: int, tokens: Sequence[int], length: int) -> KVHandle:
        base = self.bases[slot]
        n = length - base.length
        if n <= 0:
            return base.prefix(length)
        kv = self.buf.gather(slot, self.cols[slot][:n])
        return self.model.store.extend(tokens, base.length, kv)

    def close(self) -> None:
        self.buf = self.cache = None          # the buffer is freed; stored KV stays
