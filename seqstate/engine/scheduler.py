"""Continuous batching: generator calls from any number of threads share decode steps.

Each model on an engine that steps rows (a `StepBackend`) has one `Scheduler`, its runner:
`run`, `generate`, `beam`, `score`, `next_logprobs` and `stored` are what the model's calls
ask of it (`seqstate.engine.runner.Runner`; a server's model has a
`seqstate.engine.requests.RequestRunner` instead).  A call becomes a `Job` (its rows, its own
sampler, RNG, hooks and stop strings); a worker thread runs one step at a time for every
active job: newcomers join the batch (their prefixes prefilled through the store), then a
single forward feeds every live row of every job, and each job samples its own rows from its
slice of the logits.  A job that finishes leaves; its caller gets the result.

A call's result does not depend on what else runs: a job samples only with its own RNG, from
logits of its own rows.

Failures.  An exception raised by a job's own code (``needs``, ``joined``, ``wants``,
``step``, a hook's, a constraint's) fails that job alone, and its caller re-raises it with
its own traceback; the others go on.  An exception the worker cannot pin on one job (the
batched forward failing) fails every job running in the batch, which is then discarded and
replaced by a fresh one, so the model stays usable.  A caller that stops listening (an
abandoned stream, a KeyboardInterrupt while waiting) cancels its job.  A caller never waits
on a dead worker: if the worker thread is gone it raises instead, and the next call starts a
new worker.

A full KV cache pauses the newest jobs (see `seqstate.engine.running`).
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from seqstate.backends.base import Handle, Scored
from seqstate.engine import logprob_jobs
from seqstate.engine.beam import BeamJob
from seqstate.engine.decode import DecodeJob
from seqstate.engine.job import Job
from seqstate.engine.rows import Decoding, LiveRow, RowRequest, RowResult
from seqstate.engine.runner import unobserved
from seqstate.engine.running import _Run
from seqstate.engine.waiting import PAUSE, POLL_SECONDS, Caller
from seqstate.errors import ModelClosed
from seqstate.sampling.params import BeamSearch

__all__ = ["Job", "Scheduler", "IDLE_SECONDS", "POLL_SECONDS"]

IDLE_SECONDS = 2.0      # the worker thread exits after this long with nothing to do


class Scheduler:
    """Runs every active job of one model, one batched step at a time, on a worker thread."""

    def __init__(self, model) -> None:
        self.model = model
        self._cv = threading.Condition()
        self._pending: list[Job] = []
        self._worker: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._arrivals = itertools.count()
        atexit.register(_stop, weakref.ref(self))

    def execute(self, job: Job, caller: Caller | None = None) -> Generator[Any, None, Any]:
        """Run ``job`` with everyone else's; yields what it delivers, returns its result.
        An awaiting ``caller`` is yielded `PAUSE` whenever the job has nothing new, and woken
        when it has; past the caller's deadline the job is cancelled and `CallTimeout`
        raised.  Closing the generator early cancels the job: its rows leave the batch at
        the next step."""
        if threading.current_thread() is self._worker:      # a hook calling a generator
            return (yield from self._alone(job))
        caller = caller or Caller()      # built here: it belongs to the run of this thread
        caller.left(POLL_SECONDS)            # an interrupted run's call is refused unqueued
        job.wake = caller.wake
        with self._cv:
            job.order = next(self._arrivals)
            self._pending.append(job)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._serve, daemon=True,
                                                name=f"seqstate-scheduler-{self.model.name}")
                self._worker.start()
            self._cv.notify()
        finished = False
        try:
            while True:
                message = self._receive(job, caller)
                if message is None:
                    yield PAUSE
                    continue
                kind, payload = message
                if kind == "items":
                    yield from payload
                else:
                    finished = True
                    return _outcome(kind, payload)
        finally:
            if not finished:
                job.cancelled = True          # the worker drops it at its next step

    def run_job(self, job: Job) -> Any:
        """`execute` ``job`` to its end, dropping what it delivers; returns its result.  Its
        caller has no deadline and blocks, and the run it belongs to may interrupt it
        (`seqstate.engine.waiting.interruptible`)."""
        steps = self.execute(job)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value

    def close(self) -> None:
        """End the worker: the calls it runs or holds fail with `ModelClosed`, their rows
        released; returns once it has ended (so the engine can let go of its memory)."""
        with self._cv:
            self._closed = True
            worker = self._worker
            self._cv.notify_all()
        if worker is not None and worker is not threading.current_thread():
            worker.join()

    # -- a model's calls -----------------------------------------------------------------------
    def run(self, requests: Sequence[RowRequest], decoding: Decoding = Decoding(),
            observe: Callable[[list[LiveRow]], Sequence[Any]] = unobserved,
            caller: Caller | None = None) -> Generator[Any, None, list[RowResult]]:
        """Continue every row (a `DecodeJob`), sharing decode steps with concurrent calls;
        yields what ``observe`` returns after each step (and `PAUSE` to an awaiting
        ``caller``), returns the results."""
        return self.execute(DecodeJob(self.model, requests, decoding, observe), caller)

    def generate(self, requests: Sequence[RowRequest], decoding: Decoding = Decoding()
                 ) -> list[RowResult]:
        """`run` to its end: the results."""
        return self.run_job(DecodeJob(self.model, requests, decoding))

    def beam(self, groups: Sequence[Sequence[tuple[RowRequest, float, int]]],
             params: BeamSearch, on_step: Callable[[], None] | None = None,
             caller: Caller | None = None
             ) -> Generator[Any, None, list[list[tuple[RowResult, float, int]]]]:
        """Beam-search each group (one batch item's incoming beams: request, weight, length)
        as a `BeamJob`.  Returns, per group, up to ``width`` ``(result, score, origin)``
        triples sorted best-first; ``origin`` is the index of the incoming beam (within its
        group) the result descends from.  ``on_step`` runs on the worker after every step."""
        return self.execute(BeamJob(self.model, groups, params, on_step), caller)

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
              store: bool = False) -> list[Scored]:
        """Teacher-forced log-probs of each pair's continuation, on the worker in parts
        (`seqstate.engine.logprob_jobs.score_in_parts`)."""
        return logprob_jobs.score_in_parts(self, pairs, store=store)

    def next_logprobs(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Float32 log-softmax ``(len(rows), V)`` of the next token after each row, read in
        the running batch (`seqstate.engine.logprob_jobs.next_in_batch`)."""
        return logprob_jobs.next_in_batch(self, rows)

    def stored(self, rows: Sequence[Sequence[int]]) -> list[Handle]:
        """Handles on each ``row[:-1]``'s KV, stored on the worker
        (`seqstate.engine.logprob_jobs.store_in_parts`)."""
        return logprob_jobs.store_in_parts(self, rows)

    # -- the caller's side ---------------------------------------------------------------------
    def _receive(self, job: Job, caller: Caller) -> tuple[str, Any] | None:
        """The job's next message; None where an awaiting caller must wait for it.  Raises
        if the worker died without sending it, or `CallTimeout` past the caller's deadline."""
        while True:
            wait = caller.left(POLL_SECONDS)
            try:
                return job.outbox.get_nowait() if caller.awaits else job.outbox.get(timeout=wait)
            except queue.Empty:
                pass
            worker = job.worker or self._worker
            if worker is None or not worker.is_alive():
                try:                          # it may have answered just before it ended
                    return job.outbox.get_nowait()
                except queue.Empty:
                    raise RuntimeError(
                        f"the scheduler's worker thread of model {self.model.name!r} ended "
                        "without finishing this call; call again (a new worker starts)") from None
            if caller.awaits:
                return None

    def _alone(self, job: Job) -> Generator[Any, None, Any]:
        """Run ``job`` on this thread with a batch of its own (nested calls)."""
        job.order = next(self._arrivals)
        run = _Run(self.model.backend)
        run.waiting.append(job)
        try:
            while True:
                # its run's buffers are its own: a call nested in a hook runs inside a step
                # whose buffers are in use
                with self.model.lock, torch.inference_mode():
                    try:
                        run.step()
                    except BaseException as exc:  # noqa: BLE001 - the batch failed this job
                        run.reset(exc)
                while not job.outbox.empty():
                    kind, payload = job.outbox.get()
                    if kind != "items":
                        return _outcome(kind, payload)
                    yield from payload
        finally:
            run.close()

    # -- the worker ---------------------------------------------------------------------------
    def _serve(self) -> None:
        run: _Run | None = None
        try:
            self.model.backend.on_worker_start()
            run = _Run(self.model.backend)
            # the worker runs nothing but engine steps: inference mode once, not once a step;
            # its jobs' steps share the tensors they write while it lives (its run's buffers)
            with torch.inference_mode():
                while True:
                    with self._cv:
                        if self._closed:
                            self._end(run)
                            return
                        if not self._pending and not run.jobs:
                            if not self._stopping:
                                self._cv.wait(IDLE_SECONDS)
                            if not self._pending:
                                self._worker = None   # a later call starts a new worker
                                run.close()
                                return
                        run.waiting += self._take()
                    with self.model.lock:
                        try:
                            run.step()
                        except BaseException as exc:  # noqa: BLE001 - every running job's
                            run.reset(exc)
        except BaseException as exc:              # noqa: BLE001 - the worker itself broke
            with self._cv:
                orphans, self._pending = self._pending, []
                for job in (run.jobs if run is not None else []) + orphans:
                    job.send("error", exc)
                if self._worker is threading.current_thread():
                    self._worker = None

    def _end(self, run: _Run) -> None:
        """Fail every job with `ModelClosed` and end this worker (with ``_cv`` held)."""
        closed = ModelClosed(f"model {self.model.name!r} was closed (model.close()) while "
                             "this call ran; load it again to run more calls")
        run.waiting += self._take()
        run.reset(closed)
        for job in run.waiting:
            job.send("error", closed)
        run.waiting = []
        run.close()
        self._worker = None

    def _take(self) -> list[Job]:
        """The pending jobs, now this worker's (with ``_cv`` held)."""
        new, self._pending = self._pending, []
        for job in new:
            job.worker = threading.current_thread()
        return new


def _outcome(kind: str, payload: Any) -> Any:
    """A job's last message: its result, or its error raised."""
    if kind == "error":
        raise payload
    return payload


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
