"""Generator calls as scheduler jobs: forward the live rows, then the :class:`Stepper`."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from seqstate.engine.rows import LiveRow, RowRequest, RowResult
from seqstate.engine.scheduler import Job
from seqstate.engine.step import DEFAULT_MAX_BACKTRACKS, Stepper
from seqstate.sampling.params import Sampler

__all__ = ["generate", "run", "next_logits", "commit", "DecodeJob", "FIRST_CAPACITY"]

FIRST_CAPACITY = 64    # tokens a slot is prepared to grow by before the backend grows it


def next_logits(model, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Next-token logits (B, V) of each row, through stored KV (prefilling what is missing)."""
    with model.lock, torch.inference_mode():
        batch = model.backend.batch()
        try:
            slots = batch.add(rows, 1)
            return batch.forward(slots, [r[-1] for r in rows])
        finally:
            batch.close()


def commit(batch, slot: int, row: LiveRow) -> RowResult:
    """Store a finished row's new KV and freeze its result."""
    return row.result(batch.commit(slot, row.tokens, row.kv_valid(batch.length(slot))))


class DecodeJob(Job):
    """One call's rows: sampled with the call's own sampler, RNG and hooks.

    ``observe(rows)`` runs after every step (on the worker) and returns items for the caller,
    e.g. stream chunks; it must not keep references to the rows.
    """

    def __init__(self, model, requests: Sequence[RowRequest], sampler: Sampler,
                 rng: torch.Generator | None, hooks: Sequence, max_backtracks: int,
                 observe: Callable[[list[LiveRow]], Sequence[Any]]) -> None:
        super().__init__()
        self.model, self.requests, self.observe = model, requests, observe
        self.rows = [LiveRow(req, model.vocab, model.eos_token_ids) for req in requests]
        self.stepper = Stepper(model, requests, sampler, rng, hooks, max_backtracks, rows=self.rows)
        self.results: dict[int, RowResult] = {}

    def needs(self) -> tuple[list[Sequence[int]], int]:
        width = max(r.max_new for r in self.requests)
        return [r.tokens for r in self.requests], min(width, FIRST_CAPACITY) + 1

    def joined(self, slots: list[int]) -> None:
        self.slots = list(slots)
        self.slot_of = dict(enumerate(self.slots))              # row index -> slot

    def wants(self) -> tuple[list[int], list[int]]:
        live = self.stepper.live
        return [self.slot_of[i] for i in live], [self.rows[i].tokens[-1] for i in live]

    def step(self, batch, logits: torch.Tensor) -> bool:
        # sample, run hooks, accept; a rollback forgets the dropped KV; finished rows leave
        for ev in self.stepper.step(logits):
            row, slot = self.rows[ev.row], self.slot_of[ev.row]
            if ev.rolled_back:
                batch.truncate(slot, len(row.tokens) - 1)
            if row.done and ev.row not in self.results:
                self.results[ev.row] = commit(batch, slot, row)
                batch.release(slot)
                self.slots.remove(slot)
        self.deliver(self.observe(self.rows))
        if self.stepper.done:
            self.finish([self.results[i] for i in range(len(self.rows))])
            return True
        return False


def run(model, requests: Sequence[RowRequest], sampler: Sampler,
        rng: torch.Generator | None, hooks: Sequence = (),
        max_backtracks: int = DEFAULT_MAX_BACKTRACKS,
        observe: Callable[[list[LiveRow]], Sequence[Any]] = lambda rows: ()
        ) -> Generator[Any, None, list[RowResult]]:
    """Continue every row, sharing decode steps with concurrent calls on the same model.

    Yields what ``observe`` returns after each step; returns the results.  Nothing visible
    outside is mutated: new KV goes into new stored KV, and an exception leaves every
    existing state as it was.
    """
    job = DecodeJob(model, requests, sampler, rng, hooks, max_backtracks, observe)
    return (yield from model.scheduler.execute(job))


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
