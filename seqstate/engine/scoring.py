"""Work that decodes nothing, as scheduler jobs: teacher-forced scoring and next-token logits.

Each runs whole on the worker between two decode steps, so it is serialised with every other
call's steps through the scheduler, never beside it under a lock of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqstate.backends.base import Handle
from seqstate.engine.job import Job

__all__ = ["score", "next_logits", "BackendJob"]


class BackendJob(Job):
    """``work(backend)`` at once on the worker; its result is the call's."""

    joins = False

    def __init__(self, work: Callable[[Any], Any]) -> None:
        super().__init__()
        self.work = work

    def run(self, backend) -> None:
        self.finish(self.work(backend))


def score(model, prefixes: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
          ) -> list[list[tuple[list[float], Handle]]]:
    """Log-probs of every continuation's tokens after every prefix, with a handle on
    ``prefix + continuation[:-1]``; ``result[p][c]`` (see ``Backend.score``).

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> options = [model.encode(" yes"), model.encode(" no")]
    >>> [[(yes, _), (no, _)]] = ss.engine.score(model, [model.encode("Is it?")], options)
    >>> len(yes) == len(options[0])
    True
    """
    return model.scheduler.run(BackendJob(lambda backend: backend.score(prefixes, continuations)))


def next_logits(model, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Next-token logits (B, V) of each row, through stored KV (prefilling what is missing)."""
    def work(backend) -> torch.Tensor:
        batch = backend.batch()
        try:
            slots = batch.add(rows, 1)
            return batch.forward(slots, [r[-1] for r in rows])
        finally:
            batch.close()
    return model.scheduler.run(BackendJob(work))
