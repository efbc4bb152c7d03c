"""How the caller of one generator call waits for the engine: its deadline, and whether it
blocks its thread or awaits in an event loop.

A runner's ``run`` and ``beam`` are Python generators that the call drives.  A thread's call
blocks inside them until the engine has something for it.  An event loop's call
(``await gen.acall(...)``, ``async for chunk in gen.astream(...)``) must not block: where the
engine has nothing yet, the runner yields `PAUSE` instead, and the call's driver awaits
`Caller.wait`; the engine's thread wakes it with `Caller.wake` when it delivers.  No thread
is spent per call, so any number of calls from one loop join the running batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator

from seqstate.errors import CallTimeout, Interrupted

__all__ = ["Caller", "PAUSE", "Pause", "POLL_SECONDS", "INTERRUPT_POLL_SECONDS",
           "interruptible", "check_interrupted"]

POLL_SECONDS = 0.5      # how often a waiting caller makes sure its engine is still alive
INTERRUPT_POLL_SECONDS = 0.1    # how often a caller inside `interruptible` looks at its event

# the interrupt event of the program run (``ss.run_batch``) this thread's calls belong to
_INTERRUPT: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "seqstate_interrupt", default=None)


@contextlib.contextmanager
def interruptible(event: threading.Event) -> Iterator[None]:
    """Within this block (one thread or task), a call made raises `Interrupted` within
    `INTERRUPT_POLL_SECONDS` of ``event`` being set, and its rows leave the batch at the next
    step: how ``run_batch`` ends every running program when it is interrupted."""
    token = _INTERRUPT.set(event)
    try:
        yield
    finally:
        _INTERRUPT.reset(token)


def check_interrupted(event: threading.Event | None = None) -> None:
    """Raise `Interrupted` where ``event`` is set (None: the interrupt of the run this thread's
    calls belong to, if any)."""
    event = _INTERRUPT.get() if event is None else event
    if event is not None and event.is_set():
        raise Interrupted("the program run this call belongs to was interrupted (Ctrl-C, or "
                          "its arun_batch was cancelled or timed out); its rows leave the "
                          "batch at the next step")


class Pause:
    """What a runner yields to an event loop's call while the engine has nothing for it."""

    def __repr__(self) -> str:
        return "PAUSE"


PAUSE = Pause()


class Caller:
    """The caller of one call: its deadline (``time.monotonic()``; None: none) and, for a
    coroutine, the event loop it awaits in (None: a thread that blocks)."""

    def __init__(self, timeout: float | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.loop = loop
        self._event = asyncio.Event() if loop is not None else None
        self.interrupt = _INTERRUPT.get()

    @property
    def awaits(self) -> bool:
        """Whether the call awaits in an event loop (its runner yields `PAUSE` to wait)."""
        return self.loop is not None

    def left(self, poll: float) -> float:
        """Seconds to wait before looking again: ``poll``, or less where the deadline is
        nearer; raises `CallTimeout` once the deadline has passed, `Interrupted` once the run
        the call belongs to was interrupted."""
        if self.interrupt is not None:
            check_interrupted(self.interrupt)
            poll = min(poll, INTERRUPT_POLL_SECONDS)
        if self.deadline is None:
            return poll
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CallTimeout(f"the call ran past its timeout={self.timeout:g} s; its rows "
                              "leave the batch at the next step and nothing it held is kept "
                              "(pass a larger timeout=, or None for none)")
        return min(poll, left)

    def wake(self) -> None:
        """Wake the awaiting call (from any thread); a blocking caller needs no waking."""
        if self._event is not None:
            try:
                self.loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:        # the loop is closed: no one is awaiting any more
                pass

    async def wait(self, poll: float = POLL_SECONDS) -> None:
        """Await the next `wake`, or ``poll`` seconds, or the deadline, whichever comes first
        (the runner then looks again: whether its engine is alive, whether the deadline has
        passed)."""
        if not self._event.is_set():
            if self.deadline is not None:
                poll = max(0.0, min(poll, self.deadline - time.monotonic()))
            timer = self.loop.call_later(poll, self._event.set)
            try:
                await self._event.wait()
            finally:
                timer.cancel()
        self._event.clear()


