"""What a step keeps from one to the next: large tensors it writes, the helper thread that
computes a large CPU batch's log-softmax beside the step, and that log-softmax in chunks."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from seqstate.backends.base import single_threaded_torch

__all__ = ["StepBuffers", "shared_buffers", "TwoEnded", "Lead", "Computed", "OVERLAP_ELEMENTS",
           "CHUNK_ELEMENTS"]

# logits (rows x vocab) from which a CPU step computes the log-softmax on a helper thread while
# it finds the best tokens, masks and samples (torch releases the GIL): below it, handing over
# costs more than it saves
OVERLAP_ELEMENTS = 1 << 19
# rows of such a log-softmax computed at once (as elements): the helper takes them from the
# front, the step's own thread from the back once it has nothing else to do
CHUNK_ELEMENTS = 1 << 19


class StepBuffers:
    """What steps keep from one to the next: large tensors they write (masked logits, a large
    batch's log-probs, gathered rows) and the helper thread that computes a large batch's
    log-softmax.  A new tensor of (64, 49152) floats each step costs the page faults of
    mapping it (~3 ms on a VM, more than the step's own work) whenever the C allocator has
    handed the memory back to the system, which glibc's moving thresholds make a matter of
    the process's history."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._helper: ThreadPoolExecutor | None = None
        self.lead = Lead()            # the helper's first share of a large log-softmax

    def tensor(self, name: str, like: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """A tensor of ``like``'s dtype, device and shape (with ``rows`` rows if given), kept
        under ``name`` and grown when asked for more rows than before.  Valid until the next
        request for ``name``."""
        n = like.shape[0] if rows is None else rows
        b = self._tensors.get(name)
        if (b is None or b.shape[0] < n or b.shape[1:] != like.shape[1:]
                or b.dtype != like.dtype or b.device != like.device
                or b.is_inference() and not torch.is_inference_mode_enabled()):
            b = self._tensors[name] = torch.empty((max(n, 1), *like.shape[1:]),
                                                  dtype=like.dtype, device=like.device)
        return b[:n]

    def helper(self) -> ThreadPoolExecutor:
        """One thread of its own, single-threaded torch (no OpenMP team to spin beside ours)."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, "seqstate-step", initializer=single_threaded_torch)
            weakref.finalize(self, self._helper.shutdown, wait=False)
        return self._helper

    def close(self) -> None:
        """Drop the tensors and end the helper thread, if one was started."""
        self._tensors.clear()
        if self._helper is not None:
            self._helper.shutdown(wait=False)
            self._helper = None


class _Shared(threading.local):
    buffers: StepBuffers | None = None            # this thread's, inside `shared_buffers`


shared = _Shared()


@contextlib.contextmanager
def shared_buffers() -> Iterator[StepBuffers]:
    """Steppers stepping on this thread inside the block share one `StepBuffers` (an engine
    worker's steps, one job's after another's), dropped at its end; elsewhere each stepper
    keeps its own."""
    before = shared.buffers
    shared.buffers = buffers = StepBuffers()
    try:
        yield buffers
    finally:
        shared.buffers = before
        buffers.close()


class Lead:
    """How much of a large log-softmax the helper takes in its first operation: what it can
    compute while the step's own thread is busy alone (greedy's reductions, the masks, the
    accepts), estimated from the last steps.  Between two operations the helper needs the GIL,
    which the step's thread, running Python, gives up only every few milliseconds (the
    interpreter's switch interval) or when it waits: one long first operation instead of
    several short ones keeps the helper computing the whole time it works alone (measured on
    64 rows of 49,152 logits: a 0.35 ms chunk often took 0.7-1.5 ms to hand back)."""

    def __init__(self) -> None:
        self.alone = 0.0              # seconds the step's thread worked before waiting
        self.per_element = 0.0        # seconds a chunk took per logit, its fastest

    def rows(self, vocab: int) -> int:
        """Rows of ``vocab`` logits the helper computes in the time the step works alone."""
        if not self.per_element:
            return 0
        return int(self.alone / (self.per_element * vocab))

    def update(self, alone: float, per_element: float | None) -> None:
        """One step's measures, half the weight of the estimate."""
        self.alone = _halfway(self.alone, alone)
        if per_element:
            self.per_element = _halfway(self.per_element, per_element)


def _halfway(estimate: float, measured: float) -> float:
    """``measured`` averaged with ``estimate``, or ``measured`` alone where none is made yet."""
    return (estimate + measured) / 2 if estimate else measured


class TwoEnded:
    """``logits.log_softmax(-1)`` into ``out`` in chunks of rows, computed from the front by
    the helper thread (from `start` on: first as many chunks as ``lead`` expects it to finish
    before the step's thread asks, in one operation, then one by one) and from the back by
    the step's thread once it waits for the result (`get`): the two threads meet where their
    work balances, whatever the step did before waiting."""

    def __init__(self, logits: torch.Tensor, out: torch.Tensor, lead: Lead | None = None) -> None:
        self.logits, self.out, self.lead = logits, out, lead or Lead()
        self.rows = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
        self.front, self.back = 0, -(-logits.shape[0] // self.rows)     # chunks not yet taken
        self.lock = threading.Lock()
        self.helper = None
        self.began = 0.0
        self.per_element: float | None = None       # seconds per logit, the fastest chunk's

    def start(self, helper: ThreadPoolExecutor) -> TwoEnded:
        first = max(1, self.lead.rows(self.logits.shape[-1]) // self.rows)
        self.began = time.perf_counter()
        self.helper = helper.submit(self._from_front, first)
        return self

    def _take(self, front: bool, count: int = 1) -> range | None:
        """The next ``count`` chunks (at most) from one end; None when none is left."""
        with self.lock:
            if self.front >= self.back:
                return None
            if front:
                taken = range(self.front, min(self.back, self.front + count))
                self.front = taken.stop
                return taken
            self.back -= 1
            return range(self.back, self.back + 1)

    def _compute(self, chunks: range) -> None:
        """The log-softmax of ``chunks``' rows, timed: the fastest per logit is kept (an
        operation that ends while the other thread runs Python returns only when that thread
        lets go of the GIL, so the slower ones measure the wait)."""
        rows = slice(chunks.start * self.rows, chunks.stop * self.rows)
        t = time.perf_counter()
        torch.log_softmax(self.logits[rows], -1, out=self.out[rows])
        per_element = (time.perf_counter() - t) / max(1, self.out[rows].numel())
        with self.lock:
            if self.per_element is None or per_element < self.per_element:
                self.per_element = per_element

    def _chunks(self, front: bool) -> None:
        while (taken := self._take(front)) is not None:
            self._compute(taken)

    def _from_front(self, first: int) -> None:
        # in the inference mode ``out`` was made in: only that mode may write it
        with torch.inference_mode(self.out.is_inference()):
            taken = self._take(True, first)
            if taken is not None:
                self._compute(taken)
                self._chunks(True)

    def get(self) -> torch.Tensor:
        alone = time.perf_counter() - self.began
        self._chunks(False)
        self.helper.result()
        self.lead.update(alone, self.per_element)
        return self.out

    def cancel(self) -> None:
        """Take no more chunks and wait for the helper's: a step that fails leaves nothing
        writing into the kept tensor that the next step fills."""
        with self.lock:
            self.back = self.front
        self.helper.result()


class Computed:
    """A log-softmax computed at once (a small batch, or off the CPU)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def get(self) -> torch.Tensor:
        return self.value

    def cancel(self) -> None:
        pass
