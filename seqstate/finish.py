"""Why a generator call ended on a row: one declared vocabulary for every engine.

The engine finishes rows with these values, the generation layer adds the ones only it can
tell (a value its schema refuses, a scoring call), and slicing marks a call it cut short.
"""

from __future__ import annotations

import enum

__all__ = ["FinishReason"]


class FinishReason(enum.StrEnum):
    """Why a generator call ended on a row (``state.finish_reason``, ``Span.finish_reason``).

    A `str`: members equal, hash and print as their plain strings, so
    ``state.finish_reason == "eos"`` holds and a list of reasons reads
    ``['eos', 'max_tokens']``.

    - ``stop``: a ``stop_at=`` string was generated (the value excludes it).
    - ``eos``: the model ended free text with an end-of-sequence token.
    - ``max_tokens``: the call's ``max_tokens`` (or the context's room) ran out.
    - ``constraint_complete``: the constraint is satisfied: nothing more may follow, or the
      model chose EOS where the text is complete.  A constrained row has a value only when
      it ends so, or at a stop string where its text is complete.
    - ``dead_end``: no token may follow (the constraint and the hooks' bans allow none),
      or a server ended a constraint that was not complete.
    - ``max_backtracks``: hooks asked for more resamples or rollbacks than the call's
      ``max_backtracks``.
    - ``invalid``: a JSON value the grammar allowed failed its schema's validation
      (``uniqueItems``, ...); its value is None.
    - ``scored``: option scoring (``choice(..., method="score")``) picked the option.
    - ``sliced``: slicing cut the call's tokens short; its value is gone.

    Examples
    --------
    >>> import seqstate as ss
    >>> s = ss.text(ss.models.testing.tiny())("Hello", max_tokens=2)
    >>> s.finish_reason in (ss.FinishReason.EOS, ss.FinishReason.MAX_TOKENS)
    True
    >>> [ss.FinishReason.STOP, ss.FinishReason("eos")]
    ['stop', 'eos']
    """

    STOP = "stop"
    EOS = "eos"
    MAX_TOKENS = "max_tokens"
    CONSTRAINT_COMPLETE = "constraint_complete"
    DEAD_END = "dead_end"
    MAX_BACKTRACKS = "max_backtracks"
    INVALID = "invalid"
    SCORED = "scored"
    SLICED = "sliced"

    def __repr__(self) -> str:
        return repr(self.value)
