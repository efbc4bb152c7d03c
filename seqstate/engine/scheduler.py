"""Continuous batching: generator calls from any number of threads share decode steps.

Each model has one `Scheduler`.  A call becomes a `Job` (its rows, its own
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

A full KV cache.  An engine whose rows share a fixed cache (llama.cpp's ``n_ctx`` cells)
evicts stored KV no live state pins when it runs out, and raises `CacheFullError` when nothing
is left to evict.  The newest running jobs are then paused: their slots go back (their KV
stored, evictable), their tokens, cursors and RNG stay, and they wait.  When a job leaves,
waiting jobs join again oldest first, re-adding their rows (prefilling what the store lost),
and go on exactly where they were: a paused call's result is the one it has alone (within
llama.cpp's cell-order noise there).  A newcomer whose prefill finds the cache full waits
too, after pausing newer jobs if any run.  Only a job that cannot fit with no other job
running fails, with `ContextOverflowError`.  (The HF engine never pauses: its store budget is
soft and its decode buffers grow.)
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import queue
import threading
import weakref
from collections.abc import Generator, Sequence
from typing import Any

import torch

from seqstate.backends.base import CacheFullError
from seqstate.errors import ContextOverflowError

__all__ = ["Job", "Scheduler", "IDLE_SECONDS", "POLL_SECONDS"]

IDLE_SECONDS = 2.0      # the worker thread exits after this long with nothing to do
POLL_SECONDS = 0.5      # how often a waiting caller makes sure the worker is still alive


class Job:
    """One generator call inside the scheduler.  Subclasses give ``needs``, ``joined``,
    ``wants`` and ``step``, and may give ``pause``.

    Everything a job does runs on the worker thread; the caller only reads its outbox.
    """

    def __init__(self) -> None:
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.slots: list[int] = []
        self.order = 0          # arrival order: the newest jobs pause first when the cache is full
        self.worker: threading.Thread | None = None     # the worker thread holding this job

    def needs(self) -> tuple[list[Sequence[int]], int]:
        """``(rows, extra)``: the rows to add to the batch (as they are now: a paused job
        asks again for its live rows) and the tokens each may grow by."""
        raise NotImplementedError

    def joined(self, slots: list[int]) -> None:
        """This job's rows are in the batch, in ``slots`` (one per row of `needs()`)."""
        raise NotImplementedError

    def start(self, batch) -> None:
        """Join ``batch`` alone: add this job's rows (prefilling through the store)."""
        rows, extra = self.needs()
        self.slots = list(batch.add(rows, extra))
        self.joined(list(self.slots))

    def wants(self) -> tuple[list[int], list[list[int]]]:
        """``(slots, feeds)`` to feed this step: one or more tokens per slot."""
        raise NotImplementedError

    def step(self, batch, logits: list[torch.Tensor]) -> bool:
        """Consume this job's logits, ``(len(feeds[j]), V)`` per slot; True when finished."""
        raise NotImplementedError

    def pause(self, batch) -> None:
        """Leave ``batch`` for now (its KV cache is full): give every slot back and keep the
        rest, so that `needs()` later asks for the rows as they are."""
        self._release(batch)

    # -- talking to the caller ----------------------------------------------------------------
    def deliver(self, items: Sequence[Any]) -> None:
        if items:
            self.outbox.put(("items", items))

    def finish(self, result: Any) -> None:
        self.outbox.put(("done", result))

    def fail(self, batch, exc: BaseException) -> None:
        try:
            self._release(batch)
        finally:
            self.outbox.put(("error", exc))

    def _release(self, batch) -> None:
        slots, self.slots = self.slots, []
        for slot in slots:
            batch.release(slot)


class Scheduler:
    """Runs every active job of one model, one batched step at a time, on a worker thread."""

    def __init__(self, model) -> None:
        self.model = model
        self._cv = threading.Condition()
        self._pending: list[Job] = []
        self._worker: threading.Thread | None = None
        self._stopping = False
        self._arrivals = itertools.count()
        atexit.register(_stop, weakref.ref(self))

    def execute(self, job: Job) -> Generator[Any, None, Any]:
        """Run ``job`` with everyone else's; yields what it delivers, returns its result."""
        if threading.current_thread() is self._worker:      # a hook calling a generator
            return (yield from self._alone(job))
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
                kind, payload = self._receive(job)
                if kind == "items":
                    yield from payload
                else:
                    finished = True
                    return _outcome(kind, payload)
        finally:
            if not finished:
                job.cancelled = True          # the worker drops it at its next step

    def _receive(self, job: Job) -> tuple[str, Any]:
        """The job's next message; raises if the worker died without sending it."""
        while True:
            try:
                return job.outbox.get(timeout=POLL_SECONDS)
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

    def _alone(self, job: Job) -> Generator[Any, None, Any]:
        """Run ``job`` on this thread with a batch of its own (nested calls)."""
        job.order = next(self._arrivals)
        run = _Run(self.model.backend)
        run.waiting.append(job)
        try:
            while True:
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
            if self.model.backend.capabilities.own_threads:
                _single_threaded_torch()
            run = _Run(self.model.backend)
            while True:
                with self._cv:
                    if not self._pending and not run.jobs:
                        if not self._stopping:
                            self._cv.wait(IDLE_SECONDS)
                        if not self._pending:
                            self._worker = None   # a later call starts a new worker
                            run.close()
                            return
                    run.waiting += self._take()
                with self.model.lock, torch.inference_mode():
                    try:
                        run.step()
                    except BaseException as exc:  # noqa: BLE001 - no one job's: every running one's
                        run.reset(exc)
        except BaseException as exc:              # noqa: BLE001 - the worker itself broke
            with self._cv:
                orphans, self._pending = self._pending, []
                for job in (run.jobs if run is not None else []) + orphans:
                    job.outbox.put(("error", exc))
                if self._worker is threading.current_thread():
                    self._worker = None


    def _take(self) -> list[Job]:
        """The pending jobs, now this worker's (with ``_cv`` held)."""
        new, self._pending = self._pending, []
        for job in new:
            job.worker = threading.current_thread()
        return new


class _Run:
    """A batch and the jobs one worker holds: running (rows in the batch) and waiting (not
    admitted yet, or paused while the cache was full), each list oldest first."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.batch = backend.batch()
        self.running: list[Job] = []
        self.waiting: list[Job] = []
        self.blocked = False      # the cache was full: admit no one until a job leaves

    @property
    def jobs(self) -> list[Job]:
        return self.running + self.waiting

    def step(self) -> None:
        """Admit who fits, then one forward for every running job and its sampling step."""
        self.waiting.sort(key=lambda job: job.order)
        for job in [j for j in self.jobs if j.cancelled]:
            self._end(job, RuntimeError("cancelled"))
        if not self.blocked or not self.running:
            self._admit()
        wants = {}
        for job in list(self.running):
            try:
                wants[job] = job.wants()
            except BaseException as exc:          # noqa: BLE001 - fails this job alone
                self._end(job, exc)
        logits = self._forward(wants)
        offset = 0
        for job in list(self.running):
            mine = wants[job][0]
            part = logits[offset: offset + len(mine)]
            offset += len(mine)
            try:
                done = job.step(self.batch, part)
            except BaseException as exc:          # noqa: BLE001 - fails this job alone
                self._end(job, exc)
            else:
                if done:
                    self.running.remove(job)
                    self.blocked = False

    def _forward(self, wants: dict[Job, tuple[list[int], list[list[int]]]]) -> list[torch.Tensor]:
        """Logits for every running job's feeds, pausing the newest jobs while they do not fit.
        Any other exception is no one job's: it propagates (the worker resets the batch)."""
        while self.running:
            slots = [s for job in self.running for s in wants[job][0]]
            feeds = [f for job in self.running for f in wants[job][1]]
            try:
                if all(len(f) == 1 for f in feeds):
                    return list(self.batch.forward(slots, [f[0] for f in feeds]).unsqueeze(1))
                return self.batch.extend(slots, feeds)        # a draft: logits at every token
            except ContextOverflowError as exc:
                self._settle()
                if len(self.running) == 1:                     # it does not fit even alone
                    self._end(self.running[0], exc)
                    return []
                self._pause(self.running[-1])
        return []

    def _admit(self) -> None:
        """Add waiting jobs, oldest first: all in one ``batch.add`` (one prefill, shared
        prefixes once), else one by one, so a failure is its own job's alone.  A job whose
        prefill finds the cache full makes room by pausing newer running jobs, else waits
        (with everyone after it) for a job to leave; alone, it fails."""
        queue_, self.waiting = self.waiting, []
        if len(queue_) > 1 and self._add_together(queue_):
            return
        for k, job in enumerate(queue_):
            while True:
                try:
                    job.start(self.batch)
                except CacheFullError as exc:
                    newer = [j for j in self.running if j.order > job.order]
                    if newer:
                        self._pause(newer[-1])
                        continue
                    if self.running:                  # only older jobs run: wait for one to end
                        self.waiting = sorted(self.waiting + queue_[k:], key=lambda j: j.order)
                        self.blocked = True
                        return
                    self._end(job, exc)
                except BaseException as exc:          # noqa: BLE001 - delivered to its caller
                    self._end(job, exc)
                else:
                    self.running.append(job)
                break
        self.running.sort(key=lambda j: j.order)

    def _add_together(self, jobs: list[Job]) -> bool:
        """Add every job's rows in one ``batch.add``; False (nothing added) if that fails."""
        try:
            needs = [job.needs() for job in jobs]
            slots = self.batch.add([r for rows, _ in needs for r in rows],
                                   max(e for _, e in needs))
        except BaseException:                         # noqa: BLE001 - retried one by one
            return False
        offset = 0
        for job, (rows, _) in zip(jobs, needs):
            job.slots = slots[offset: offset + len(rows)]
            offset += len(rows)
            try:
                job.joined(list(job.slots))
            except BaseException as exc:              # noqa: BLE001 - delivered to its caller
                self._end(job, exc)
            else:
                self.running.append(job)
        self.running.sort(key=lambda j: j.order)
        return True

    def _pause(self, job: Job) -> None:
        """Take ``job`` out of the batch until a job leaves."""
        self.running.remove(job)
        try:
            job.pause(self.batch)
        except BaseException as exc:                  # noqa: BLE001 - fails this job alone
            self._end(job, exc)
            return
        self.waiting = sorted(self.waiting + [job], key=lambda j: j.order)
        self.blocked = True

    def _settle(self) -> None:
        """After a forward that did not fit, cut every slot back to the KV it is known to hold
        (an engine may have written part of the failed batch)."""
        for job in self.running:
            for slot in job.slots:
                self.batch.truncate(slot, self.batch.length(slot))

    def _end(self, job: Job, exc: BaseException) -> None:
        """Fail ``job`` alone: its slots go back, its caller gets ``exc``."""
        for jobs in (self.running, self.waiting):
            if job in jobs:
                jobs.remove(job)
        self.blocked = False
        job.fail(self.batch, exc)

    def reset(self, exc: BaseException) -> None:
        """A failure no job can be blamed for: fail every running job and start a fresh batch
        (waiting jobs hold nothing in it and stay)."""
        running, self.running = self.running, []
        for job in running:
            job.slots = []                            # the whole batch is dropped below
            job.fail(self.batch, exc)
        self.close()
        self.batch = self.backend.batch()
        self.blocked = False

    def close(self) -> None:
        try:
            self.batch.close()
        except Exception:                             # noqa: BLE001 - a broken batch: dropped
            pass                                      # whole, its finalizer returns the rest


def _outcome(kind: str, payload: Any) -> Any:
    """A job's last message: its result, or its error raised."""
    if kind == "error":
        raise payload
    return payload


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
