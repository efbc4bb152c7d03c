"""Continuous batching: generator calls from any number of threads share decode steps.

Each model has one `Scheduler`.  A call becomes a `Job` (its rows, its own
sampler, RNG, hooks and stop strings); a worker thread runs one step at a time for every
active job: newcomers join the batch (their prefixes prefilled through the store), then a
single forward feeds every live row of every job, and each job samples its own rows from its
slice of the logits.  A job that finishes leaves; its caller gets the result.

A call's result does not depend on what else runs: a job samples only with its own RNG, from
logits of its own rows.  An exception inside a job (a hook's, a constraint's) fails that job
alone; its caller re-raises it.  A caller that stops listening (an abandoned stream, a
KeyboardInterrupt while waiting) cancels its job, and the others go on.
"""

from __future__ import annotations

import atexit
import ctypes
import queue
import threading
import weakref
from collections.abc import Generator, Sequence
from typing import Any

import torch

__all__ = ["Job", "Scheduler", "IDLE_SECONDS"]

IDLE_SECONDS = 2.0      # the worker thread exits after this long with nothing to do


class Job:
    """One generator call inside the scheduler.  Subclasses give ``needs``, ``joined``,
    ``wants`` and ``step``.

    Everything a job does runs on the worker thread; the caller only reads its outbox.
    """

    def __init__(self) -> None:
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.slots: list[int] = []

    def needs(self) -> tuple[list[Sequence[int]], int]:
        """``(rows, extra)``: the rows to add to the batch and the tokens each may grow by."""
        raise NotImplementedError

    def joined(self, slots: list[int]) -> None:
        """This job's rows are in the batch, in ``slots`` (one per row of `needs()`)."""
        raise NotImplementedError

    def start(self, batch) -> None:
        """Join ``batch`` alone: add this job's rows (prefilling through the store)."""
        rows, extra = self.needs()
        self.joined(batch.add(rows, extra))

    def wants(self) -> tuple[list[int], list[list[int]]]:
        """``(slots, feeds)`` to feed this step: one or more tokens per slot."""
        raise NotImplementedError

    def step(self, batch, logits: list[torch.Tensor]) -> bool:
        """Consume this job's logits, ``(len(feeds[j]), V)`` per slot; True when finished."""
        raise NotImplementedError

    # -- talking to the caller ----------------------------------------------------------------
    def deliver(self, items: Sequence[Any]) -> None:
        if items:
            self.outbox.put(("items", items))

    def finish(self, result: Any) -> None:
        self.outbox.put(("done", result))

    def fail(self, batch, exc: BaseException) -> None:
        for slot in self.slots:
            batch.release(slot)
        self.slots = []
        self.outbox.put(("error", exc))


class Scheduler:
    """Runs every active job of one model, one batched step at a time, on a worker thread."""

    def __init__(self, model) -> None:
        self.model = model
        self._cv = threading.Condition()
        self._pending: list[Job] = []
        self._worker: threading.Thread | None = None
        self._stopping = False
        atexit.register(_stop, weakref.ref(self))

    def execute(self, job: Job) -> Generator[Any, None, Any]:
        """Run ``job`` with everyone else's; yields what it delivers, returns its result."""
        if threading.current_thread() is self._worker:      # a hook calling a generator
            return (yield from self._alone(job))
        with self._cv:
            self._pending.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, daemon=True,
                                                name=f"seqstate-scheduler-{self.model.name}")
                self._worker.start()
            self._cv.notify()
        finished = False
        try:
            while True:
                kind, payload = job.outbox.get()
                if kind == "items":
                    yield from payload
                else:
                    finished = True
                    return _outcome(kind, payload)
        finally:
            if not finished:
                job.cancelled = True          # the worker drops it at its next step

    def _alone(self, job: Job) -> Generator[Any, None, Any]:
        """Run ``job`` on this thread with a batch of its own (nested calls)."""
        batch = self.model.backend.batch()
        try:
            running = self._step(batch, [], [job])
            while True:
                while not job.outbox.empty():
                    kind, payload = job.outbox.get()
                    if kind != "items":
                        return _outcome(kind, payload)
                    yield from payload
                running = self._step(batch, running, [])
        finally:
            batch.close()

    # -- the worker ---------------------------------------------------------------------------
    def _serve(self) -> None:
        if self.model.backend.capabilities.own_threads:
            _single_threaded_torch()
        batch = self.model.backend.batch()
        active: list[Job] = []
        while True:
            with self._cv:
                if not self._pending and not active:
                    if not self._stopping:
                        self._cv.wait(IDLE_SECONDS)
                    if not self._pending:
                        self._worker = None       # a later call starts a new worker
                        batch.close()
                        return
                new, self._pending = self._pending, []
            active = self._step(batch, active, new)

    def _step(self, batch, active: list[Job], new: list[Job]) -> list[Job]:
        """Admit ``new``, run one forward for every active job, return the jobs still running."""
        with self.model.lock, torch.inference_mode():
            active.extend(_admit(batch, new))
            running = []
            for job in active:
                if job.cancelled:
                    job.fail(batch, RuntimeError("cancelled"))
                else:
                    running.append(job)
            if not running:
                return []
            wants = [job.wants() for job in running]
            slots = [s for w in wants for s in w[0]]
            feeds = [f for w in wants for f in w[1]]
            try:
                if all(len(f) == 1 for f in feeds):
                    logits = list(batch.forward(slots, [f[0] for f in feeds]).unsqueeze(1))
                else:                             # a draft to verify: logits at every token
                    logits = batch.extend(slots, feeds)
            except BaseException as exc:          # noqa: BLE001 - the engine failed everyone
                for job in running:
                    job.fail(batch, exc)
                return []
            still, offset = [], 0
            for job, (mine, _) in zip(running, wants):
                part = logits[offset: offset + len(mine)]
                offset += len(mine)
                try:
                    if not job.step(batch, part):
                        still.append(job)
                except BaseException as exc:      # noqa: BLE001 - fails this job alone
                    job.fail(batch, exc)
            return still


def _outcome(kind: str, payload: Any) -> Any:
    """A job's last message: its result, or its error raised."""
    if kind == "error":
        raise payload
    return payload


def _admit(batch, jobs: list[Job]) -> list[Job]:
    """Add every newcomer's rows in one ``batch.add`` (one prefill for all of them, shared
    prefixes once); if that fails, add them one by one so a failure is its own job's alone.
    Returns the jobs that joined."""
    if len(jobs) > 1:
        try:
            needs = [job.needs() for job in jobs]
            slots = batch.add([r for rows, _ in needs for r in rows], max(e for _, e in needs))
        except BaseException:                     # noqa: BLE001 - retried job by job below
            pass
        else:
            joined, offset = [], 0
            for job, (rows, _) in zip(jobs, needs):
                mine = slots[offset: offset + len(rows)]
                offset += len(rows)
                try:
                    job.joined(mine)
                    joined.append(job)
                except BaseException as exc:      # noqa: BLE001 - delivered to its caller
                    job.slots = mine
                    job.fail(batch, exc)
            return joined
    joined = []
    for job in jobs:
        try:
            job.start(batch)
            joined.append(job)
        except BaseException as exc:              # noqa: BLE001 - delivered to its caller
            job.fail(batch, exc)
    return joined


def _single_threaded_torch() -> None:
    """Make torch's ops on this thread alone single-threaded.

    ``torch.set_num_threads`` would change every thread started later too; OpenMP's own
    ``omp_set_num_threads`` sets the calling thread's team size only.  torch sets it once per
    thread, lazily, so that happens first.  A torch without OpenMP is left as it is.
    """
    torch.get_num_threads()
    try:
        ctypes.CDLL(None).omp_set_num_threads(1)
    except (AttributeError, OSError):
        pass


def _stop(ref: weakref.ref) -> None:
    """At interpreter exit: let an idle worker finish now, so no thread is inside torch while
    the runtime shuts down."""
    scheduler = ref()
    if scheduler is None:
        return
    with scheduler._cv:
        scheduler._stopping = True
        worker = scheduler._worker
        scheduler._cv.notify_all()
    if worker is not None:
        worker.join(timeout=5)
