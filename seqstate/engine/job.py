"""A generator call as the scheduler sees it: a `Job` adds rows to the running batch, feeds
them every step and consumes their logits; its caller reads only its outbox."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqstate.backends.base import Fed
from seqstate.engine.buffers import StepBuffers

__all__ = ["Job", "last_logits"]


def last_logits(logits: torch.Tensor | Fed) -> torch.Tensor:
    """A job's logits at each slot's last fed token, ``(n, V)``: the tensor itself when every
    slot was fed one token, else each slot's last row."""
    if isinstance(logits, torch.Tensor):
        return logits
    return logits.logits[[s + n - 1 for s, n in zip(logits.starts, logits.lengths)]]  # (n, V)


class Job:
    """One generator call inside the scheduler.  Subclasses give ``needs``, ``joined``,
    ``wants`` and ``step``, and may give ``pause``.  A job that needs no rows of the batch
    (scoring) sets ``joins = False`` and gives `run` instead.

    Everything a job does runs on the worker thread; the caller only reads its outbox, and
    an event loop's caller is woken (``wake``) after every message.
    """

    joins = True            # False: the worker runs the job's parts between steps (`run`)

    def __init__(self) -> None:
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.slots: list[int] = []
        self.order = 0          # arrival order: the newest jobs pause first when the cache is full
        self.worker: threading.Thread | None = None     # the worker thread holding this job
        self.wake: Callable[[], None] = _nobody           # tells an awaiting caller to look

    def needs(self) -> tuple[list[Sequence[int]], int]:
        """``(rows, grow_by)``: the rows to add to the batch (as they are now: a paused job
        asks again for its live rows) and the tokens each may grow by."""
        raise NotImplementedError

    def joined(self, slots: list[int]) -> None:
        """This job's rows are in the batch, in ``slots`` (one per row of `needs()`)."""
        raise NotImplementedError

    def start(self, batch) -> None:
        """Join ``batch`` alone: add this job's rows (prefilling through the store)."""
        rows, grow_by = self.needs()
        self.slots = list(batch.add(rows, grow_by))
        self.joined(list(self.slots))

    def wants(self) -> tuple[list[int], list[list[int]]]:
        """``(slots, feeds)`` to feed this step: one or more tokens per slot."""
        raise NotImplementedError

    def step(self, batch, logits: torch.Tensor | Fed, buffers: StepBuffers) -> bool:
        """Consume this job's logits, ``(len(feeds[j]), V)`` per slot, or one ``(n, V)``
        tensor, a row per slot, when every slot of the step was fed one token (see
        `last_logits`); True when finished.  ``buffers``: the run's kept tensors, for the
        large ones a step writes."""
        raise NotImplementedError

    def run(self, backend) -> bool:
        """The next part of a job with ``joins = False``, on the worker between two steps;
        True when that was the last (it has called `finish` with its result), False to run
        the next part at a later step.  `CacheFullError` leaves it waiting for a job to leave,
        as a newcomer's prefill does, to run that part again."""
        raise NotImplementedError

    def pause(self, batch) -> None:
        """Leave ``batch`` for now (its KV cache is full): give every slot back and keep the
        rest, so that `needs()` later asks for the rows as they are."""
        self._release(batch)

    # -- talking to the caller ----------------------------------------------------------------
    def send(self, kind: str, payload: Any) -> None:
        """A message to the caller: ``("items", items)``, ``("done", result)`` or
        ``("error", exception)``."""
        self.outbox.put((kind, payload))
        self.wake()

    def deliver(self, items: Sequence[Any]) -> None:
        if items:
            self.send("items", items)

    def finish(self, result: Any) -> None:
        self.send("done", result)

    def fail(self, batch, exc: BaseException) -> None:
        try:
            self._release(batch)
        finally:
            self.send("error", exc)

    def _release(self, batch) -> None:
        slots, self.slots = self.slots, []
        for slot in slots:
            batch.release(slot)


def _nobody() -> None:
    """``Job.wake`` of a caller that blocks on the outbox: nothing to wake."""
