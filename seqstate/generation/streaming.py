"""What a stream shows: text no stop string or hook can still take back; draining a stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from seqstate.call import Call
from seqstate.engine.waiting import PAUSE, Caller
from seqstate.errors import ArgumentError
from seqstate.hooks import as_hook
from seqstate.state import SequenceState

__all__ = ["Chunks", "counting", "nothing", "rollback_reach", "final_state", "Stream",
           "AsyncStream"]


def nothing(rows) -> tuple:
    """The observer of a call that is not streamed: it hears from the worker once, at the end."""
    return ()


def counting(observe: Callable, bar: Any) -> Callable:
    """``observe`` that also moves the progress bar to the rows' generated tokens."""
    def both(rows):
        bar.update(sum(len(r.generated) for r in rows) - bar.n)
        return observe(rows)
    return both


class Chunks:
    """What a stream may show after each step: new text that no stop string or hook can
    still take back.  Runs on the scheduler's worker after every step of the call."""

    def __init__(self, state: SequenceState, healed: list[int], call: Call) -> None:
        self.samples, self.single = state.n_samples, len(state.rows) == 1
        self.healed, self.stops, self.hooks = healed, call.stops, bool(call.hooks)
        self.hold = rollback_reach(call.hooks)
        self.emitted = [0] * len(state.rows)

    def __call__(self, rows) -> list:
        out = []
        for i, r in enumerate(rows):
            skip = self.healed[i]
            visible = r.text[skip:]
            if r.done:
                end = len(visible) if r.value_end is None else r.value_end - skip
            else:
                end = len(visible) - (self.stops.holdback(visible) if self.stops else 0)
                if self.hooks:      # text a hook can still roll back is not streamed
                    end = min(end, r.rollback_floor(self.hold) - skip)
            if end > self.emitted[i]:
                chunk = visible[self.emitted[i]:end]
                self.emitted[i] = end
                out.append(chunk if self.single else (i // self.samples, i % self.samples, chunk))
        return out


def rollback_reach(hooks: Sequence[Callable]) -> int | None:
    """How many characters back the hooks may roll back; None when one does not say.

    A hook declares it with `Hook.lookback` (``ban_phrases`` does); without one, any
    generated text may still be rolled back, so a stream holds everything until the row ends.
    """
    reach = [as_hook(h).lookback for h in hooks]
    return None if None in reach else max(reach, default=0)


def final_state(stream: Iterator[str]) -> SequenceState:
    """Drain a ``gen.stream(...)`` iterator and return its final state."""
    while True:
        try:
            next(stream)
        except StopIteration as stop:
            return stop.value


_NO_STATE = ("the stream was closed (or cancelled, or its call failed) before its end, so "
             "it has no final state: its rows left the batch and kept nothing; the chunks it "
             "yielded are the text it wrote.  Iterate a stream to its end for its state")


class Stream:
    """A call's text as it is produced: ``for chunk in stream`` yields the chunks of
    `Generator.stream`, then ``stream.state`` is the final state (also the iterator's return
    value, ``StopIteration.value``, as for a generator).

    ``stream.close()``, or dropping the stream unfinished, ends the call's rows at the
    engine's next step.
    """

    def __init__(self, steps: Generator[Any, None, Any]) -> None:
        self._steps = steps
        self._state: Any = None
        self._closed = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._steps)
        except StopIteration as stop:
            self._state = stop.value
            raise StopIteration(stop.value) from None

    def send(self, value: Any) -> Any:
        """As a generator's ``send``: ``yield from stream`` works as with the generator."""
        return self.__next__() if value is None else self._steps.send(value)

    def throw(self, *exc: Any) -> Any:
        """As a generator's ``throw``: the exception is raised inside the call."""
        return self._steps.throw(*exc)

    def close(self) -> None:
        """End the call now: its rows leave the batch at the engine's next step."""
        self._closed = self._state is None
        self._steps.close()

    @property
    def state(self) -> Any:
        """The final state, once the stream has ended; a stream closed before its end has
        none."""
        if self._state is None:
            if self._closed:
                raise ArgumentError(_NO_STATE)
            raise ArgumentError("the stream has not ended: iterate it to its end (`for chunk "
                                "in stream`, or list(stream)) first")
        return self._state


class AsyncStream:
    """A call driven from an event loop: ``async for chunk in stream`` yields its chunks
    (those of `Generator.stream`), then ``stream.state`` is the final state; ``await
    stream.drain()`` runs it to its end and returns that state.

    The call starts at the first ``__anext__``, in the running loop: its rows join the
    model's running batch there, and while the engine has nothing new for it the stream
    awaits, so the loop runs on without a thread per call.  Cancelling the task that awaits
    the stream, ``await stream.aclose()``, or dropping the stream unfinished ends the call's
    rows at the engine's next step, releasing what they held.
    """

    def __init__(self, start: Callable[[Caller], Generator[Any, None, Any]], call: Call) -> None:
        self._start, self._call = start, call
        self._steps: Generator[Any, None, Any] | None = None
        self._caller: Caller | None = None
        self._state: Any = None
        self._ended = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Any:
        if self._ended:
            raise StopAsyncIteration
        if self._steps is None:
            self._caller = self._call.caller(asyncio.get_running_loop())
            self._steps = self._start(self._caller)
        try:
            while True:
                item = next(self._steps)
                if item is not PAUSE:
                    return item
                await self._caller.wait()
        except StopIteration as stop:
            self._ended, self._state = True, stop.value
            raise StopAsyncIteration from None
        except BaseException:               # a cancelled task, a timeout, the call's error
            self._ended = True
            self._steps.close()
            raise

    @property
    def state(self) -> Any:
        """The final state, once the stream has ended."""
        if self._state is None:
            if self._ended:
                raise ArgumentError(_NO_STATE)
            raise ArgumentError("the stream has not ended: iterate it to its end (`async for`) "
                                "or `await stream.drain()` first")
        return self._state

    async def drain(self) -> Any:
        """Run the call to its end; returns the final state."""
        async for _ in self:
            pass
        return self.state

    async def aclose(self) -> None:
        """End the call now: its rows leave the batch at the engine's next step."""
        self._ended = True
        if self._steps is not None:
            self._steps.close()
