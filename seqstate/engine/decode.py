"""Generator calls as scheduler jobs: forward the live rows, then the `Stepper`."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from seqstate.backends.base import CacheFullError, Fed
from seqstate.engine.buffers import StepBuffers
from seqstate.engine.job import Job
from seqstate.engine.rows import Decoding, LiveRow, RowRequest, RowResult
from seqstate.engine.runner import unobserved
from seqstate.engine.step import Stepper
from seqstate.engine.waiting import Caller

__all__ = ["generate", "run", "commit", "DecodeJob", "FIRST_CAPACITY"]

FIRST_CAPACITY = 64    # tokens a slot is prepared to grow by before the backend grows it


def commit(batch, slot: int, row: LiveRow) -> RowResult:
    """Store a finished row's new KV and freeze its result."""
    return row.result(batch.commit(slot, row.tokens, row.kv_valid(batch.length(slot))))


class DecodeJob(Job):
    """One call's rows, decoded as its `Decoding` says (its own sampler, RNG and hooks).

    ``observe(rows)`` runs after every step (on the worker) and returns items for the caller,
    e.g. stream chunks; it must not keep references to the rows.
    """

    def __init__(self, model, requests: Sequence[RowRequest], decoding: Decoding,
                 observe: Callable[[list[LiveRow]], Sequence[Any]] = unobserved) -> None:
        super().__init__()
        self.model, self.requests, self.observe = model, requests, observe
        self.speculate = decoding.speculate
        self.feeds: dict[int, list[int]] = {}
        self.rows = [LiveRow(req, model.vocab, model.eos_token_ids) for req in requests]
        self.stepper = Stepper(model, decoding=decoding, rows=self.rows)
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

    def step(self, batch, logits: torch.Tensor | Fed, buffers: StepBuffers) -> bool:
        # position j of every row still following its draft: sample, run hooks, accept; a row
        # stops at the first token that differs from its draft (a sampler's own choice, a
        # hook's replacement or rollback, or the end of the row)
        live = self.stepper.live
        if isinstance(logits, torch.Tensor):         # no draft this step: a row per live row
            self.stepper.step(logits, live, buffers)
        else:
            start = dict(zip(live, logits.starts))  # row -> its first row in logits.logits
            following, j, accepted = live, 0, 0
            while following:
                # hooks' events carry the logits (a hook may keep them): not a kept tensor
                into = None if self.stepper.hooks else buffers
                index = [start[i] + j for i in following]
                events = self.stepper.step(_gather(logits.logits, index, into), following,
                                           buffers)
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


def _gather(logits: torch.Tensor, index: list[int], buffers: StepBuffers | None
            ) -> torch.Tensor:
    """Rows ``index`` of ``logits`` (N, V): a view where they are consecutive, else a copy,
    into ``buffers``' kept tensor unless ``buffers`` is None."""
    first = index[0]
    if index == list(range(first, first + len(index))):
        return logits[first: first + len(index)]                                     # (B, V)
    where = torch.tensor(index, device=logits.device)
    if buffers is None:
        return logits.index_select(0, where)                                         # (B, V)
    out = buffers.tensor("stacked", logits, len(index))
    return torch.index_select(logits, 0, where, out=out)                             # (B, V)


def run(model, requests: Sequence[RowRequest], decoding: Decoding = Decoding(),
        observe: Callable[[list[LiveRow]], Sequence[Any]] = unobserved,
        caller: Caller | None = None) -> Generator[Any, None, list[RowResult]]:
    """Continue every row on ``model``'s runner (its scheduler, sharing decode steps with
    concurrent calls, or its server's requests), decoded as ``decoding`` says.

    Yields what ``observe`` returns after each step; returns the results.  Nothing visible
    outside is mutated: new KV goes into new stored KV, and an exception leaves every
    existing state as it was.  ``caller`` as in `seqstate.engine.runner.Runner.run` (None:
    no deadline; the program run this thread's call belongs to may interrupt it).
    """
    return model.runner.run(requests, decoding, observe, caller)


def generate(model, requests: Sequence[RowRequest], decoding: Decoding = Decoding()
             ) -> list[RowResult]:
    """Continue every row to completion; see `run()`."""
    return model.runner.generate(requests, decoding)
