"""The batched decode loop: forward -> constrain -> sample -> accept, on in-place buffers."""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from seqstate.engine.prefill import ensure_kv
from seqstate.engine.rows import LiveRow, RowRequest, RowResult
from seqstate.kv.buffer import KVBuffer
from seqstate.kv.hf_cache import as_cache
from seqstate.models.hf import Model
from seqstate.sampling.params import Sampler

__all__ = ["generate", "run", "next_logits"]

_FIRST_CAPACITY = 64   # decode columns preallocated before the first doubling


def _allowed(rows: Sequence[LiveRow], vocab_size: int) -> torch.Tensor | None:
    """Bool mask (B, V) of allowed tokens, or None when no row is constrained."""
    if all(r.cursor is None for r in rows):
        return None
    mask = torch.ones(len(rows), vocab_size, dtype=torch.bool)        # (B, V)
    for i, r in enumerate(rows):
        if r.cursor is not None and not r.done:
            allowed = r.cursor.allowed()                                # (V_tok,)
            mask[i, : allowed.shape[0]] = allowed
            mask[i, allowed.shape[0]:] = False
    return mask


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


def _store_row(model: Model, row: LiveRow, buf: KVBuffer, slot: int, past: int) -> RowResult:
    """Write the row's new KV back as a segment and freeze its result."""
    end = row.kv_valid()
    if end > row.base:
        handle = model.store.extend(row.tokens, row.base, buf.take(slot, past, past + end - row.base))
    else:
        handle = row.handle.prefix(end)
    return row.result(handle)


def run(model: Model, requests: Sequence[RowRequest], sampler: Sampler,
        rng: torch.Generator | None) -> Generator[list[tuple[int, str]], None, list[RowResult]]:
    """Continue every row; yields ``[(row, text chunk), ...]`` per step, returns the results.

    Holds the model lock for the whole call.  Nothing visible outside is mutated: new KV goes
    into new store segments, and an exception leaves every existing state as it was.
    """
    with model.lock, torch.inference_mode():
        handles = ensure_kv(model, [r.tokens for r in requests])
        vocab, eos = model.vocab, model.eos_token_ids
        rows = [LiveRow(req, h, vocab, eos) for req, h in zip(requests, handles)]
        width = max(r.max_new for r in requests)
        buf, mask = _load(model, handles, min(width, _FIRST_CAPACITY) + 1)
        past = buf.length                                            # prompts right-aligned here
        padded = len({h.length for h in handles}) > 1                # else no mask is needed
        cache = as_cache(buf)
        live = list(range(len(rows)))                                # slot -> row index
        results: dict[int, RowResult] = {}
        while len(results) < len(rows):
            slots = [rows[i] for i in live]
            buf.ensure(buf.length + 1)
            if mask.shape[1] < buf.capacity:
                mask = torch.cat([mask, mask.new_zeros(len(live), buf.capacity - mask.shape[1])], 1)
            # 1. forward the last token of every live row
            ids = torch.tensor([[r.tokens[-1]] for r in slots], device=model.device)       # (B, 1)
            pos = torch.tensor([[len(r.tokens) - 1] for r in slots], device=model.device)  # (B, 1)
            mask[:, buf.length] = 1
            step_mask = mask[:, : buf.length + 1].to(model.device) if padded else None
            logits = model.forward(ids, step_mask, pos, cache)
            buf.length += 1
            model.count(decode_tokens=sum(not r.done for r in slots))
            # 2. constrain: banned tokens get -inf; a row with nothing allowed is a dead end
            logprobs = logits.log_softmax(dim=-1)                                       # (B, V)
            allowed = _allowed(slots, logits.shape[-1])
            if allowed is not None:
                dead = ~allowed.any(dim=-1)                                             # (B,)
                for i in dead.nonzero().flatten().tolist():
                    if not slots[i].done:
                        slots[i].finish("dead_end")
                allowed[dead] = True
                logits = logits.masked_fill(~allowed, float("-inf"))
            # 3. sample
            chosen = sampler.choose(logits, rng).tolist()                               # (B,)
            # 4. accept: append, advance cursors, check stops; finished rows write their KV back
            chunks = []
            for slot, r in enumerate(slots):
                if r.done and live[slot] in results:
                    continue
                if not r.done:
                    r.fed += 1
                    chunk = r.accept(chosen[slot], logprobs[slot, chosen[slot]].item())
                    if chunk:
                        chunks.append((live[slot], chunk))
                if r.done:
                    results[live[slot]] = _store_row(model, r, buf, slot, past)
            yield chunks
            # 5. drop finished rows from the batch once they are a quarter of it
            finished = [s for s, i in enumerate(live) if i in results]
            if finished and len(finished) * 4 >= len(live) and len(finished) < len(live):
                keep = torch.tensor([s for s, i in enumerate(live) if i not in results])
                buf.keep_rows(keep)
                mask = mask.index_select(0, keep)
                live = [live[s] for s in keep.tolist()]
        return [results[i] for i in range(len(rows))]


def generate(model: Model, requests: Sequence[RowRequest], sampler: Sampler,
             rng: torch.Generator | None = None) -> list[RowResult]:
    """Continue every row to completion; see :func:`run`."""
    steps = run(model, requests, sampler, rng)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
