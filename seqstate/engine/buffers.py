"""What a step keeps from one to the next: large tensors it writes, the helper thread that
computes a large CPU batch's log-softmax beside the step, and that log-softmax in chunks."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from seqstate.backends.base import single_threaded_torch

__all__ = ["StepBuffers", "shared_buffers", "TwoEnded", "Computed", "OVERLAP_ELEMENTS",
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


class TwoEnded:
    """``logits.log_softmax(-1)`` into ``out`` in chunks of rows, computed from the front by
    the helper thread (from `start` on) and from the back by the step's thread once it waits
    for the result (`get`): the two threads meet where their work balances, whatever the
    step did before waiting."""

    def __init__(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        self.logits, self.out = logits, out
        self.rows = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
        self.front, self.back = 0, -(-logits.shape[0] // self.rows)     # chunks not yet taken
        self.lock = threading.Lock()
        self.helper = None

    def start(self, helper: ThreadPoolExecutor) -> TwoEnded:
        self.helper = helper.submit(self._from_front)
        return self

    def _take(self, front: bool) -> int | None:
        with self.lock:
            if self.front >= self.back:
                return None
            if front:
                self.front += 1
                return self.front - 1
            self.back -= 1
            return self.back

    def _chunks(self, front: bool) -> None:
        while (k := self._take(front)) is not None:
            rows = slice(k * self.rows, (k + 1) * self.rows)
            torch.log_softmax(self.logits[rows], -1, out=self.out[rows])

    def _from_front(self) -> None:
        # in the inference mode ``out`` was made in: only that mode may write it
        with torch.inference_mode(self.out.is_inference()):
            self._chunks(True)

    def get(self) -> torch.Tensor:
        self._chunks(False)
        self.helper.result()
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
