"""The only module that speaks transformers' ``Cache`` API.

`BufferLayer` is a ``DynamicLayer`` that appends in place into a `KVBuffer`
instead of concatenating (a full KV copy per step), and returns views of the filled columns.
Bit-identical to ``DynamicLayer``; it saves the copy that dominates a step at long contexts
and large batches, and costs nothing at one short row (docs/performance.md).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from seqstate.backends.hf.buffer import KVBuffer

__all__ = ["BufferLayer", "as_cache"]


class BufferLayer(DynamicLayer):
    """One model layer's view of a shared `KVBuffer`."""

    def __init__(self, buffer: KVBuffer, layer: int) -> None:
        super().__init__()
        self.buffer = buffer
        self.layer = layer
        self.is_initialized = True
        self._data: torch.Tensor | None = None        # the buffer's tensor the views are of

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._data is not self.buffer.data:       # first use, or the buffer grew
            self._data = self.buffer.data
            self._k, self._v = self._data[self.layer].unbind(0)   # (rows, heads, capacity, dim)
        n, t = self.buffer.length, key_states.shape[-2]
        # narrow + copy_: a third of indexing's cost, once per layer a step
        self._k.narrow(2, n, t).copy_(key_states)
        self._v.narrow(2, n, t).copy_(value_states)
        self.keys, self.values = self._k.narrow(2, 0, n + t), self._v.narrow(2, 0, n + t)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.buffer.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.buffer.length + query_length, 0


def as_cache(buffer: KVBuffer) -> Cache:
    """A transformers ``Cache`` whose layers write into ``buffer``.

    The caller advances ``buffer.length`` after each forward.
    """
    return Cache(layers=[BufferLayer(buffer, i) for i in range(buffer.data.shape[0])])
