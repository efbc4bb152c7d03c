"""The batched decode loop: forward, then the :class:`Stepper`, on in-place KV buffers."""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from seqstate.engine.prefill import ensure_kv
from seqstate.engine.rows import LiveRow, RowRequest, RowResult
from seqstate.engine.step import DEFAULT_MAX_BACKTRACKS, Stepper
from seqstate.kv.buffer import KVBuffer
from seqstate.kv.hf_cache import as_cache
from seqstate.models.hf import Model
from seqstate.sampling.params import Sampler

__all__ = ["generate", "run", "next_logits"]

_FIRST_CAPACITY = 64   # decode columns preallocated before the first doubling


def _load(model: Model, handles: Sequence, extra: int) -> tuple[KVBuffer, torch.Tensor]:
    """A decode buffer holding every handle's KV right-aligned at one column, and its mask."""
    past = max(h.length for h in handles)
    buf = KVBuffer(model.num_layers, model.kv_heads, model.head_dim, len(handles), past + extra,
                   model.dtype, model.device)
    mask = torch.zeros(len(handles), buf.capacity, dtype=torch.long)           # (B, C)
    for i, h in enumerate(handles):
        buf.load(i, h, past)
        mask[i, past - h.length: past] = 1
    buf.length = past
    return buf, mask


def next_logits(model: Model, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Next-token logits (B, V) of each row, computed through the store's KV (prefilling as needed)."""
    with model.lock, torch.inference_mode():
        handles = ensure_kv(model, rows)
        buf, mask = _load(model, handles, 1)
        ids = torch.tensor([[r[-1]] for r in rows], device=model.device)                # (B, 1)
        pos = torch.tensor([[len(r) - 1] for r in rows], device=model.device)           # (B, 1)
        mask[:, buf.length] = 1
        return model.forward(ids, mask.to(model.device), pos, as_cache(buf))


def _store_row(model: Model, row: LiveRow, buf: KVBuffer, slot: int) -> RowResult:
    """Write the row's new KV back as a segment and freeze its result."""
    n = row.kv_valid() - row.base
    if n > 0:
        handle = model.store.extend(row.tokens, row.base, buf.gather(slot, row.cols[:n]))
    else:
        handle = row.handle.prefix(row.base + n)
    return row.result(handle)


def run(model: Model, requests: Sequence[RowRequest], sampler: Sampler,
        rng: torch.Generator | None, hooks: Sequence = (),
        max_backtracks: int = DEFAULT_MAX_BACKTRACKS) -> Generator[list[LiveRow], None, list[RowResult]]:
    """Continue every row; yields the live rows after each step, returns the results.

    Holds the model lock for the whole call.  Nothing visible outside is mutated: new KV goes
    into new store segments, and an exception leaves every existing state as it was.
    """
    with model.lock, torch.inference_mode():
        handles = ensure_kv(model, [r.tokens for r in requests])
        rows = [LiveRow(req, model.vocab, model.eos_token_ids, h) for req, h in zip(requests, handles)]
        stepper = Stepper(model, requests, sampler, rng, hooks, max_backtracks, rows=rows)
        width = max(r.max_new for r in requests)
        buf, mask = _load(model, handles, min(width, _FIRST_CAPACITY) + 1)
        padded = len({h.length for h in handles}) > 1                # else no mask is needed
        cache = as_cache(buf)
        slots = list(range(len(rows)))                               # buffer slot -> row index
        results: dict[int, RowResult] = {}
        while not stepper.done:
            buf.ensure(buf.length + 1)
            if mask.shape[1] < buf.capacity:
                mask = torch.cat([mask, mask.new_zeros(len(slots), buf.capacity - mask.shape[1])], 1)
            # forward the last token of every row in the buffer (finished ones ride along)
            col = buf.length
            ids = torch.tensor([[rows[i].tokens[-1]] for i in slots], device=model.device)      # (B, 1)
            pos = torch.tensor([[len(rows[i].tokens) - 1] for i in slots], device=model.device)  # (B, 1)
            mask[:, col] = 1
            step_mask = mask[:, : col + 1].to(model.device) if padded else None
            logits = model.forward(ids, step_mask, pos, cache)                                  # (B, V)
            buf.length += 1
            slot_of = {r: s for s, r in enumerate(slots)}
            live = stepper.live
            for i in live:
                rows[i].cols.append(col)
            model.count(decode_tokens=len(live))
            # sample, run hooks, accept; a rollback masks the dropped columns out (a KV crop)
            for ev in stepper.step(logits[[slot_of[i] for i in live]]):
                row = rows[ev.row]
                if ev.rolled_back:
                    keep = len(row.tokens) - 1 - row.base
                    mask[slot_of[ev.row], row.cols[keep:]] = 0
                    del row.cols[keep:]
                    padded = True
                if row.done and ev.row not in results:
                    results[ev.row] = _store_row(model, row, buf, slot_of[ev.row])
            yield rows
            # drop finished rows from the batch once they are a quarter of it
            done = [s for s, i in enumerate(slots) if i in results]
            if done and len(done) * 4 >= len(slots) and len(done) < len(slots):
                keep_slots = torch.tensor([s for s, i in enumerate(slots) if i not in results])
                buf.keep_rows(keep_slots)
                mask = mask.index_select(0, keep_slots)
                slots = [slots[s] for s in keep_slots.tolist()]
        return [results[i] for i in range(len(rows))]


def generate(model: Model, requests: Sequence[RowRequest], sampler: Sampler,
             rng: torch.Generator | None = None, hooks: Sequence = (),
             max_backtracks: int = DEFAULT_MAX_BACKTRACKS) -> list[RowResult]:
    """Continue every row to completion; see :func:`run`."""
    steps = run(model, requests, sampler, rng, hooks, max_backtracks)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
