"""Work that decodes nothing, as scheduler jobs: teacher-forced scoring and next-token
log-probs.

Each runs whole on the worker between two decode steps, so it is serialised with every other
call's steps through the scheduler, never beside it under a lock of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqstate.backends.base import Scored
from seqstate.engine.job import Job

__all__ = ["score", "next_logprobs", "BackendJob"]


class BackendJob(Job):
    """``work(backend)`` at once on the worker; its result is the call's."""

    joins = False

    def __init__(self, work: Callable[[Any], Any]) -> None:
        super().__init__()
        self.work = work

    def run(self, backend) -> None:
        self.finish(self.work(backend))


def score(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, store: bool = False
          ) -> list[Scored]:
    """Teacher-forced log-probs of each ``(prefix, continuation)`` pair, on the worker (see
    ``Backend.score``).

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> prompt = model.encode("Is it?")
    >>> yes, no = ss.engine.score(model, [(prompt, model.encode(" yes")),
    ...                                   (prompt, model.encode(" no"))])
    >>> len(yes.logprobs) == len(model.encode(" yes")), yes.handle is None
    (True, True)
    """
    return model.scheduler.run(BackendJob(lambda backend: backend.score(pairs, store=store)))


def next_logprobs(model, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Float32 log-softmax ``(len(rows), V)`` of the next token after each row, on the worker
    (each row's KV stored; see ``Backend.next_logprobs``)."""
    return model.scheduler.run(BackendJob(lambda backend: backend.next_logprobs(rows)))
