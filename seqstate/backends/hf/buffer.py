"""Preallocated decode buffers: the batched working copy of KV during one engine call.

Layout ``(layers, 2, rows, kv_heads, capacity, head_dim)``; columns are token slots.  Unused
slots are zeros (never uninitialised memory: padded slots are read, masked, by attention).
"""

from __future__ import annotations

import torch

from seqstate.backends.hf.store import KVHandle

__all__ = ["KVBuffer"]


class KVBuffer:
    """Batched KV working space that grows by doubling and writes new tokens in place."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, rows: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.data = torch.zeros(layers, 2, rows, kv_heads, capacity, head_dim,
                                dtype=dtype, device=device)
        self.length = 0                               # columns in use, the same for every row

    @property
    def rows(self) -> int:
        return self.data.shape[2]

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def ensure(self, columns: int) -> None:
        """Make room for ``columns`` slots (amortised doubling; copies only on growth)."""
        if columns <= self.capacity:
            return
        new_cap = max(columns, 2 * self.capacity)
        shape = list(self.data.shape)
        shape[4] = new_cap
        grown = self.data.new_zeros(shape)
        grown[..., : self.length, :] = self.data[..., : self.length, :]
        self.data = grown

    def load(self, row: int, handle: KVHandle, end: int) -> None:
        """Copy ``handle``'s KV into ``row`` so that it ends just before column ``end``."""
        col = end - handle.length
        for seg, lo, hi in handle.pieces():
            self.load_span(row, seg, lo, hi, col)
            col += hi - lo

    def load_span(self, row: int, segment, lo: int, hi: int, col: int) -> None:
        """Copy a stored segment's columns ``[lo, hi)`` into ``row`` from column ``col``."""
        self.data[:, :, row, :, col: col + hi - lo] = segment.kv[:, :, :, lo:hi]

    def take(self, row: int, lo: int, hi: int) -> torch.Tensor:
        """An owned copy of ``row``'s columns ``[lo, hi)``: ``(layers, 2, kv_heads, n, head_dim)``."""
        return self.data[:, :, row, :, lo:hi].clone()

    def gather(self, row: int, columns: list[int]) -> torch.Tensor:
        """An owned copy of ``row``'s ``columns`` in order (rows with rollback holes)."""
        if columns and columns[-1] - columns[0] == len(columns) - 1:
            return self.take(row, columns[0], columns[-1] + 1)
        index = torch.tensor(columns, dtype=torch.long, device=self.data.device)
        return self.data[:, :, row].index_select(3, index)

    def add_rows(self, n: int) -> None:
        """``n`` more rows of zeros at the end."""
        if n:
            shape = list(self.data.shape)
            shape[2] = n
            self.data = torch.cat([self.data, self.data.new_zeros(shape)], dim=2)

    def shift(self, delta: int) -> None:
        """Move every filled column ``delta`` slots right (or left when negative)."""
        self.ensure(self.length + max(delta, 0))
        moved = self.data.new_zeros(self.data.shape)
        if delta >= 0:
            moved[..., delta: delta + self.length, :] = self.data[..., : self.length, :]
        else:
            moved[..., : self.length + delta, :] = self.data[..., -delta: self.length, :]
        self.data = moved
        self.length += delta

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (finished rows stop costing compute)."""
        self.data = self.data.index_select(2, rows.to(self.data.device))
