"""Work that decodes nothing, as scheduler jobs: next-token log-probs and teacher-forced
scoring.

Next-token log-probs join the running batch as a call's rows do (`NextJob`): their rows are
prefilled through the store when they are admitted, their last tokens are fed in the same
forward as every running call's, and they leave stored after that one step.  Scoring runs on
the worker in parts between decode steps (`ROWS_PER_STEP` distinct rows a part, its own
batches: a continuation's many positions and trie forks), so it too is serialised with every
other call's steps through the scheduler, never beside it under a lock of its own, and a long
scoring call does not stop other calls for its length.  Both keep memory bounded by the
scoring budget (`seqstate.backends.teacher_forcing`), a group of rows at a time.  The scheduler's
`score`, `next_logprobs` and `stored` are these (`score_in_parts`, `next_in_batch`,
`store_in_parts`); `score` and `next_logprobs` here ask any model's runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqstate.backends.base import Fed, Handle, Scored
from seqstate.backends.teacher_forcing import prefix_groups, store_rows
from seqstate.engine.buffers import StepBuffers
from seqstate.engine.job import Job, last_logits
from seqstate.sampling.functions import check_logprobs

__all__ = ["score", "next_logprobs", "score_in_parts", "next_in_batch", "store_in_parts",
           "BackendJob", "NextJob"]


class BackendJob(Job):
    """Work on the backend in parts, one part per scheduler step (between other calls'
    decode steps): ``parts[i](backend)`` in turn; the job's result is ``combine`` of their
    results (by default the one part's result)."""

    joins = False

    def __init__(self, *parts: Callable[[Any], Any],
                 combine: Callable[[list[Any]], Any] | None = None) -> None:
        super().__init__()
        self.parts = parts
        self.combine = combine or (lambda results: results[0])
        self.results: list[Any] = []

    def run(self, backend) -> bool:
        self.results.append(self.parts[len(self.results)](backend))
        if len(self.results) < len(self.parts):
            return False
        self.finish(self.combine(self.results))
        return True


# distinct rows whose pairs one scheduler step scores: a long scoring call lets other calls
# decode between its parts (the backend bounds each part's memory by its own budget)
ROWS_PER_STEP = 64


def _parts(keys: Sequence[Any]) -> list[list[int]]:
    """Indexes of ``keys`` in parts of at most `ROWS_PER_STEP` distinct keys, in order of
    first appearance (equal keys in the same part)."""
    distinct = list(dict.fromkeys(keys))
    part_of = {key: i // ROWS_PER_STEP for i, key in enumerate(distinct)}
    parts: list[list[int]] = [[] for _ in range(-(-len(distinct) // ROWS_PER_STEP))]
    for i, key in enumerate(keys):
        parts[part_of[key]].append(i)
    return parts


def _run_in_parts(scheduler, items: Sequence[Any], keys: Sequence[Any],
                  work: Callable[[Any, list[Any]], list[Any]]) -> list[Any]:
    """``work(backend, items)`` over parts of ``items`` grouped by key, one part per step;
    the results in the order of ``items``."""
    parts = _parts(keys)
    if not parts:
        return []

    def combine(results: list[list[Any]]) -> list[Any]:
        out: list[Any] = [None] * len(items)
        for indexes, got in zip(parts, results):
            for i, value in zip(indexes, got):
                out[i] = value
        return out

    steps = [lambda backend, ix=ix: work(backend, [items[i] for i in ix]) for ix in parts]
    return scheduler.run_job(BackendJob(*steps, combine=combine))


def score(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, store: bool = False
          ) -> list[Scored]:
    """Teacher-forced log-probs of each ``(prefix, continuation)`` pair (see
    ``Backend.score``), by ``model``'s runner.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> prompt = model.encode("Is it?")
    >>> yes, no = ss.engine.score(model, [(prompt, model.encode(" yes")),
    ...                                   (prompt, model.encode(" no"))])
    >>> len(yes.logprobs) == len(model.encode(" yes")), isinstance(yes.greedy, bool)
    (True, True)
    """
    return model.runner.score(pairs, store=store)


def next_logprobs(model, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Float32 log-softmax ``(len(rows), V)`` of the next token after each row, by
    ``model``'s runner (identical rows computed once, each row's KV stored)."""
    return model.runner.next_logprobs(rows)


def score_in_parts(scheduler, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                   store: bool = False) -> list[Scored]:
    """`score` on the scheduler's worker, `ROWS_PER_STEP` distinct prefixes a step."""
    return _run_in_parts(scheduler, pairs, [tuple(p) for p, _ in pairs],
                         lambda backend, part: backend.score(part, store=store))


class NextJob(Job):
    """Rows whose next-token distribution is read in the running batch: they join as a
    call's rows do, their last tokens are fed with everyone's, and each row is stored whole
    before it leaves; the result is the float32 log-softmax ``(rows, V)``."""

    def __init__(self, rows: Sequence[Sequence[int]]) -> None:
        super().__init__()
        self.rows = [list(r) for r in rows]

    def needs(self) -> tuple[list[Sequence[int]], int]:
        return self.rows, 1

    def joined(self, slots: list[int]) -> None:
        self.slots = list(slots)

    def wants(self) -> tuple[list[int], list[list[int]]]:
        return list(self.slots), [[row[-1]] for row in self.rows]

    def step(self, batch, logits: torch.Tensor | Fed, buffers: StepBuffers) -> bool:
        out = check_logprobs(last_logits(logits).float().log_softmax(-1))
        for slot, row in zip(self.slots, self.rows):
            batch.commit(slot, row, len(row))
        self._release(batch)
        self.finish(out)
        return True


def next_in_batch(scheduler, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """`next_logprobs` in the scheduler's running batch: groups of rows within the scoring
    budget join it one after another (`NextJob`)."""
    backend = scheduler.model.backend
    distinct = list(dict.fromkeys(tuple(r) for r in rows))
    out = torch.empty(len(distinct), backend.vocab_size, device=backend.device)
    for group in prefix_groups(backend, distinct):
        out[group] = scheduler.run_job(NextJob([distinct[i] for i in group]))
    where = {row: i for i, row in enumerate(distinct)}
    return out[[where[tuple(r)] for r in rows]]


def store_in_parts(scheduler, rows: Sequence[Sequence[int]]) -> list[Handle]:
    """States' handles on each ``row[:-1]``'s KV, stored on the scheduler's worker (computing
    only what the store lacks)."""
    return _run_in_parts(scheduler, rows, [tuple(r) for r in rows], store_rows)
