"""The batched decode loop over any backend: forward the live rows, then the :class:`Stepper`."""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from seqstate.engine.rows import LiveRow, RowRequest, RowResult
from seqstate.engine.step import DEFAULT_MAX_BACKTRACKS, Stepper
from seqstate.sampling.params import Sampler

__all__ = ["generate", "run", "next_logits", "FIRST_CAPACITY"]

FIRST_CAPACITY = 64    # tokens a slot is prepared to grow by before the backend grows it


def next_logits(model, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Next-token logits (B, V) of each row, through stored KV (prefilling what is missing)."""
    with model.lock, torch.inference_mode():
        batch, _ = model.backend.open(rows, 1)
        try:
            return batch.forward(range(len(rows)), [r[-1] for r in rows])
        finally:
            batch.close()


def commit(batch, slot: int, row: LiveRow) -> RowResult:
    """Store a finished row's new KV and freeze its result."""
    return row.result(batch.commit(slot, row.tokens, row.kv_valid(batch.length(slot))))


def run(model, requests: Sequence[RowRequest], sampler: Sampler,
        rng: torch.Generator | None, hooks: Sequence = (),
        max_backtracks: int = DEFAULT_MAX_BACKTRACKS) -> Generator[list[LiveRow], None, list[RowResult]]:
    """Continue every row; yields the live rows after each step, returns the results.

    Holds the model lock for the whole call.  Nothing visible outside is mutated: new KV goes
    into new stored KV, and an exception leaves every existing state as it was.
    """
    with model.lock, torch.inference_mode():
        width = max(r.max_new for r in requests)
        batch, _ = model.backend.open([r.tokens for r in requests], min(width, FIRST_CAPACITY) + 1)
        try:
            rows = [LiveRow(req, model.vocab, model.eos_token_ids) for req in requests]
            stepper = Stepper(model, requests, sampler, rng, hooks, max_backtracks, rows=rows)
            slots = list(range(len(rows)))                           # batch slot -> row index
            results: dict[int, RowResult] = {}
            while not stepper.done:
                slot_of = {r: s for s, r in enumerate(slots)}
                live = stepper.live
                # 1. forward the last token of every live row (one batch)
                logits = batch.forward([slot_of[i] for i in live],
                                       [rows[i].tokens[-1] for i in live])              # (B, V)
                # 2. sample, run hooks, accept; a rollback forgets the dropped KV
                for ev in stepper.step(logits):
                    row, slot = rows[ev.row], slot_of[ev.row]
                    if ev.rolled_back:
                        batch.truncate(slot, len(row.tokens) - 1)
                    if row.done and ev.row not in results:
                        results[ev.row] = commit(batch, slot, row)
                yield rows
                # 3. drop finished rows from the batch once they are a quarter of it
                done = [s for s, i in enumerate(slots) if i in results]
                if done and len(done) * 4 >= len(slots) and len(done) < len(slots):
                    keep = [s for s, i in enumerate(slots) if i not in results]
                    batch.reorder(keep)
                    slots = [slots[s] for s in keep]
            return [results[i] for i in range(len(rows))]
        finally:
            batch.close()


def generate(model, requests: Sequence[RowRequest], sampler: Sampler,
             rng: torch.Generator | None = None, hooks: Sequence = (),
             max_backtracks: int = DEFAULT_MAX_BACKTRACKS) -> list[RowResult]:
    """Continue every row to completion; see :func:`run`."""
    steps = run(model, requests, sampler, rng, hooks, max_backtracks)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
