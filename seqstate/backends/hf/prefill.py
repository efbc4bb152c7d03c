"""Prefill: compute the KV of every uncached prefix once, and store it.

Rows are matched against the store; only tails without KV are run.  Rows of a batch that share
a long uncached prefix (a system prompt) get that prefix computed once first.  Tails of
different lengths run together: cached KV right-aligned, tails left-padded, a 2-D attention
mask with holes and explicit position ids (exact only with both; docs/concepts/kv.md).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from seqstate.backends.hf.buffer import KVBuffer
from seqstate.backends.hf.cache import as_cache
from seqstate.backends.hf.guard import HookGuard
from seqstate.backends.hf.store import KVHandle, KVStore
from seqstate.backends.prefixes import SHARED_PREFIX_MIN, ensure_shared, ensure_stored

__all__ = ["ensure_kv", "ensure_shared_kv", "run_tails", "Network", "SHARED_PREFIX_MIN", "PREFILL_CHUNK",
           "PREFILL_BATCH_TOKENS"]


class Network(Protocol):
    """What prefill and the batch use of their backend (`seqstate.backends.hf.backend.HFBackend`,
    whose attributes document these): the network's geometry, its one forward, the store."""

    store: KVStore
    guard: HookGuard
    pad_token_id: int
    num_layers: int
    kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor, cache: Any, *, logits: bool | torch.Tensor = True
                ) -> torch.Tensor | None: ...

    def count(self, **deltas: int) -> None: ...

PREFILL_CHUNK = 1024          # longest tail run in one forward (longer tails run in chunks)
PREFILL_BATCH_TOKENS = 8192   # rows x (past + tail) columns per forward


def run_tails(backend: Network, rows: Sequence[tuple[Sequence[int], KVHandle]]
              ) -> list[KVHandle]:
    """One batched forward over the next chunk of each row's uncached tail; stores the KV.

    Returns handles on the new KV (the caller holds them so eviction cannot drop it mid-call).
    """
    store = backend.store
    tails = [tokens[h.length: h.length + PREFILL_CHUNK] for tokens, h in rows]
    past = max(h.length for _, h in rows)                           # cached KV, right-aligned
    width = max(len(t) for t in tails)
    buf = KVBuffer(backend.num_layers, backend.kv_heads, backend.head_dim, len(rows),
                   past + width, backend.dtype, backend.device)
    for i, (_, h) in enumerate(rows):
        buf.load(i, h, past)
    buf.length = past
    # ids and positions from one flat array (a few operations, not several per row); rows of
    # one length (no mask) take the model's own positions, the cache's length on
    plain = all(h.length == past and len(t) == width for (_, h), t in zip(rows, tails))
    flat = array("q")
    for tail in tails:
        flat.extend([backend.pad_token_id] * (width - len(tail)) + list(tail))
    if not plain:
        for (_, h), tail in zip(rows, tails):
            flat.extend([0] * (width - len(tail)) + list(range(h.length, h.length + len(tail))))
    device = backend.device
    inputs = torch.frombuffer(flat, dtype=torch.int64).view(-1, len(rows), width).to(device)
    mask = None
    if not plain:
        cells = array("q")
        for (_, h), tail in zip(rows, tails):
            cells.extend([0] * (past - h.length) + [1] * h.length
                         + [0] * (width - len(tail)) + [1] * len(tail))
        mask = torch.frombuffer(cells, dtype=torch.int64).view(len(rows), past + width)
    scratch = store.frozen                # read before the forward: what it computes is scratch
    backend.forward(inputs[0], None if mask is None else mask.to(device),
                    None if plain else inputs[1], as_cache(buf), logits=False)
    backend.count(prefill_tokens=sum(len(t) for t in tails))
    return [store.extend(tokens, h.length, buf.take(i, past + width - len(tail), past + width),
                         base=h, scratch=scratch)
            for i, ((tokens, h), tail) in enumerate(zip(rows, tails))]


def _run_packed(backend: Network, todo: list[tuple[tuple[int, ...], KVHandle]]) -> list[KVHandle]:
    """Every uncached tail, packed into forwards of at most ``PREFILL_BATCH_TOKENS``; a
    handle per row of ``todo``, in its order."""
    order = sorted(range(len(todo)), key=lambda i: todo[i][1].length)  # less padding
    stored: list[KVHandle] = []
    batch: list[tuple[tuple[int, ...], KVHandle]] = []
    for row in [todo[i] for i in order]:
        grown = batch + [row]
        cols = max(h.length for _, h in grown) + min(
            max(len(t) - h.length for t, h in grown), PREFILL_CHUNK)
        if batch and len(grown) * cols > PREFILL_BATCH_TOKENS:
            stored.extend(run_tails(backend, batch))
            batch = []
        batch.append(row)
    stored.extend(run_tails(backend, batch))
    by_row = dict(zip(order, stored))
    return [by_row[i] for i in range(len(todo))]


def ensure_kv(backend: Network, rows: Sequence[Sequence[int]]) -> list[KVHandle]:
    """Make sure ``row[:-1]`` of every row has KV in the store; return hard-pinned handles on it
    (see `seqstate.backends.prefixes.ensure_stored`).  A hooked model outside
    ``frozen_store()`` is refused first (`seqstate.ActivationHookError`)."""
    backend.guard.check(rescan=True)
    return ensure_stored(backend.store, rows, lambda todo: _run_packed(backend, todo),
                         backend.count)


def ensure_shared_kv(backend: Network, targets: Sequence[Sequence[int]]) -> list[KVHandle]:
    """Compute what two or more ``targets`` share beyond the store, once; hard-pinned handles
    on each target's longest prefix with KV (`seqstate.backends.prefixes.ensure_shared`).
    A hooked model outside ``frozen_store()`` is refused first."""
    backend.guard.check(rescan=True)
    return ensure_shared(backend.store, targets, lambda todo: _run_packed(backend, todo),
                         backend.count)
