"""One worker's batch and the jobs it holds; `_Run.step` is the scheduler's step: admit who
fits, one forward for every running job, then each job's own sampling step.

A full KV cache.  An engine whose rows share a fixed cache (llama.cpp's ``n_ctx`` cells)
evicts the least recently used stored KV (live states' too) when it runs out, and raises
`CacheFullError` when nothing
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

import torch

from seqstate.backends.base import CacheFullError, Fed
from seqstate.engine.buffers import StepBuffers
from seqstate.engine.job import Job
from seqstate.errors import ContextOverflowError

__all__ = ["_Run"]


class _Run:
    """A batch and the jobs one worker holds: running (rows in the batch) and waiting (not
    admitted yet, or paused while the cache was full), each list oldest first.  The run
    owns the tensors its jobs' steps write (``buffers``), kept from step to step while it
    lives and handed to each job's step."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.batch = backend.batch()
        self.buffers = StepBuffers()
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
        if self.waiting and (not self.blocked or not self.running):
            self._admit()
        wants = {}
        for job in list(self.running):
            try:
                wants[job] = job.wants()
            except BaseException as exc:          # noqa: BLE001 - fails this job alone
                self._end(job, exc)
        logits = self._forward(wants)
        offset, alone = 0, len(self.running) == 1
        for job in list(self.running):
            mine = wants[job][0]
            part = logits if alone else logits[offset: offset + len(mine)]
            offset += len(mine)
            try:
                done = job.step(self.batch, part, self.buffers)
            except BaseException as exc:          # noqa: BLE001 - fails this job alone
                self._end(job, exc)
            else:
                if done:
                    self.running.remove(job)
                    self.blocked = False

    def _forward(self, wants: dict[Job, tuple[list[int], list[list[int]]]]
                 ) -> torch.Tensor | Fed:
        """Logits for every running job's feeds (as `Job.step` takes them), pausing the newest
        jobs while they do not fit.  Any other exception is no one job's: it propagates (the
        worker resets the batch)."""
        while self.running:
            slots = [s for job in self.running for s in wants[job][0]]
            feeds = [f for job in self.running for f in wants[job][1]]
            try:
                if all(len(f) == 1 for f in feeds):           # (B, V): a row per slot
                    return self.batch.forward(slots, [f[0] for f in feeds])
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
        prefixes once), else one by one, so a failure is its own job's alone; a job that
        joins no rows runs its next part here.  A job whose prefill finds the cache full
        makes room by pausing newer running jobs, else waits (with everyone after it) for a
        job to leave; alone, it fails."""
        queue_, self.waiting = self.waiting, []
        joining = [j for j in queue_ if j.joins]
        if len(joining) > 1 and self._add_together(joining):
            queue_ = [j for j in queue_ if not j.joins]
        for k, job in enumerate(queue_):
            while True:
                try:
                    if job.joins:
                        job.start(self.batch)
                    elif not job.run(self.backend):
                        self.waiting.append(job)      # its next part runs at the next step
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
                    if job.joins:
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
        self.buffers.close()
        try:
            self.batch.close()
        except Exception:                             # noqa: BLE001 - a broken batch: dropped
            pass                                      # whole, its finalizer returns the rest
