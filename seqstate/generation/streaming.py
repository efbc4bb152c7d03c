"""What a stream shows: text no stop string or hook can still take back; draining a stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from seqstate.call import Call
from seqstate.hooks import as_hook
from seqstate.state import SequenceState

__all__ = ["Chunks", "counting", "nothing", "rollback_reach", "final_state"]


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
