"""Generator calls as scheduler jobs: forward the live rows, then the `Stepper`."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from seqstate.backends.base import CacheFullError
from seqstate.engine.buffers import StepBuffers
from seqstate.engine.job import Job
from seqstate.engine.rows import LiveRow, RowRequest, RowResult
from seqstate.engine.step import DEFAULT_MAX_BACKTRACKS, Stepper
from seqstate.sampling.params import Sampler

__all__ = ["generate", "run", "commit", "DecodeJob", "FIRST_CAPACITY"]

FIRST_CAPACITY = 64    # tokens a slot is prepared to grow by before the backend grows it


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
                 observe: Callable[[list[LiveRow]], Sequence[Any]], speculate: bool = True) -> None:
        super().__init__()
        self.model, self.requests, self.observe = model, requests, observe
        self.speculate = speculate
        self.feeds: dict[int, list[int]] = {}
        self.rows = [LiveRow(req, model.vocab, model.eos_token_ids) for req in requests]
        self.stepper = Stepper(model, requests, sampler, rng, hooks, max_backtracks, rows=self.rows)
        self.results: dict[int, RowResult] = {}

    def needs(self) -> tuple[list[Sequence[int]], int]:
        live = self.stepper.live                 # every row at first; the unfinished on resuming
        room = max(self.rows[i].req.max_new - len(self.rows[i].generated) + self.rows[i].respelled
                   for i in live)
        return [self.rows[i].tokens for i in live], min(room, FIRST_CAPACITY) + 1

    def joined(self, slots: list[int]) -> None:
        self.slots = list(slots)
        self.slot_of = dict(zip(self.stepper.live, self.slots))   # row index -> slot

    def pause(self, batch) -> None:
        """Store the live rows' KV (evictable once released: a paused call's resumption
        finds it unless the room was needed), then give the slots back."""
        for i in self.stepper.live:
            slot = self.slot_of[i]
            try:
                batch.commit(slot, self.rows[i].tokens, self.rows[i].kv_valid(batch.length(slot)))
            except CacheFullError:
                pass                              # no room to keep it: prefilled again later
        super().pause(batch)

    # A job outlives its call where its error's traceback is kept (worker frames hold jobs):
    # once the caller has its result, the job holds no handle: its KV is the caller's alone.
    def finish(self, result: Any) -> None:
        self.stepper.close()
        super().finish(result)
        self.results = {}

    def fail(self, batch, exc: BaseException) -> None:
        self.results = {}
        self.stepper.close()
        super().fail(batch, exc)

    def wants(self) -> tuple[list[int], list[list[int]]]:
        live = self.stepper.live
        self.feeds = {i: [self.rows[i].tokens[-1], *self._draft(self.rows[i])] for i in live}
        return [self.slot_of[i] for i in live], [self.feeds[i] for i in live]

    def _draft(self, row: LiveRow) -> tuple[int, ...]:
        """Tokens the row's constraint forces next (speculation), within the row's budget."""
        if not self.speculate or row.cursor is None:
            return ()
        room = row.req.max_new - (len(row.generated) - row.respelled) - 1
        return row.cursor.draft()[:room] if room > 0 else ()

    def step(self, batch, logits: torch.Tensor | list[torch.Tensor]) -> bool:
        # position j of every row still following its draft: sample, run hooks, accept; a row
        # stops at the first token that differs from its draft (a sampler's own choice, a
        # hook's replacement or rollback, or the end of the row)
        live = self.stepper.live
        if isinstance(logits, torch.Tensor):         # no draft this step: a row per live row
            self.stepper.step(logits, live)
        else:
            mine = dict(zip(live, logits))
            following, j, accepted = live, 0, 0
            while following:
                # hooks' events carry the logits (a hook may keep them): not a kept tensor
                into = None if self.stepper.hooks else self.stepper.buffers
                events = self.stepper.step(_rows([mine[i][j] for i in following], into),
                                           following)
                kept = {ev.row for ev in events if ev.token is not None and not ev.rolled_back
                        and not self.rows[ev.row].done and j + 1 < len(self.feeds[ev.row])
                        and ev.token == self.feeds[ev.row][j + 1]}
                accepted += len(kept)
                following, j = [i for i in following if i in kept], j + 1
            drafted = sum(len(f) - 1 for f in self.feeds.values())
            self.model.count(draft_tokens_accepted=accepted,
                             draft_tokens_rejected=drafted - accepted)
        # the slot keeps the KV of the row's tokens but the last: drop rejected draft tokens
        # and what a rollback removed; finished rows store their KV and leave
        for i in live:
            row, slot = self.rows[i], self.slot_of[i]
            if batch.length(slot) > len(row.tokens) - 1:
                batch.truncate(slot, len(row.tokens) - 1)
            if row.done and i not in self.results:
                self.results[i] = commit(batch, slot, row)
                batch.release(slot)
                self.slots.remove(slot)
        self.deliver(self.observe(self.rows))
        if self.stepper.done:
            self.finish([self.results[i] for i in range(len(self.rows))])
            return True
        return False


def _rows(rows: list[torch.Tensor], buffers: StepBuffers | None) -> torch.Tensor:
    """The rows (V,) of a draft step's logits at one position as one (B, V) tensor: a view
    where they are already consecutive rows of one tensor (rows side by side that were fed
    one token each, or a single row), else a copy into ``buffers``' kept tensor (a new one
    each position would cost its page faults; a strided view, the copy that the
    log-softmax and NumPy's argmax make of it), or a new one where ``buffers`` is None.  A
    step without drafts never comes here: its jobs get the forward's (B, V) tensor as it is."""
    first = rows[0]
    step = first.shape[0] * first.element_size()
    base, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    if first.stride(0) == 1 and all(r.data_ptr() == base + k * step
                                    and r.untyped_storage().data_ptr() == storage
                                    for k, r in enumerate(rows)):
        return first.as_strided((len(rows), first.shape[0]), (first.shape[0], 1))
    if buffers is None:
        return torch.stack(rows)                                                    # (B, V)
    return torch.stack(rows, out=buffers.tensor("stacked", first[None], len(rows)))  # (B, V)


def run(model, requests: Sequence[RowRequest], sampler: Sampler,
        rng: torch.Generator | None, hooks: Sequence = (),
        max_backtracks: int = DEFAULT_MAX_BACKTRACKS,
        observe: Callable[[list[LiveRow]], Sequence[Any]] = lambda rows: (),
        speculate: bool = True) -> Generator[Any, None, list[RowResult]]:
    """Continue every row on ``model``'s runner (its scheduler, sharing decode steps with
    concurrent calls, or its server's requests).

    Yields what ``observe`` returns after each step; returns the results.  Nothing visible
    outside is mutated: new KV goes into new stored KV, and an exception leaves every
    existing state as it was.
    """
    return model.runner.run(requests, sampler, rng, hooks, max_backtracks, observe, speculate)


def generate(model, requests: Sequence[RowRequest], sampler: Sampler,
             rng: torch.Generator | None = None, hooks: Sequence = (),
             max_backtracks: int = DEFAULT_MAX_BACKTRACKS, speculate: bool = True
             ) -> list[RowResult]:
    """Continue every row to completion; see `run()`."""
    return model.runner.generate(requests, sampler, rng, hooks, max_backtracks, speculate)
