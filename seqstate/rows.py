"""The values a state is made of: rows of tokens, the spans of generator calls, and a row's
conversation record.

Everything here is a frozen value; nothing renders, generates or computes KV.  The chat
layer (`seqstate.conversation`) builds on `Chat`: its records render the next turn, so a
state continues its conversation without knowing how turns are rendered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from seqstate.backends.base import Handle as KVHandle
from seqstate.constraints.base import Cursor
from seqstate.errors import ChatTemplateError
from seqstate.finish import FinishReason

__all__ = ["Span", "Row", "Chat", "markup_end", "not_a_conversation"]


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One generator call's tokens ``[start, end)`` in a row, and what it produced.

    Attributes
    ----------
    start, end : int
        The call's tokens in the row: ``row.tokens[start:end]``.
    generator : Generator
        The generator that made them.
    finish_reason : FinishReason
        Why the call ended (see `SequenceState.finish_reason`).
    value : object
        What the call produced: its text, the chosen option, the parsed JSON; None when a
        constrained call did not complete or the span was cut by slicing.
    scores : dict of str to float, optional
        Option scoring (``choice(..., method="score")``): every option's score.
    name : str, optional
        The call's ``name=``: the capture ``state[name]`` reads.
    """

    start: int
    end: int
    generator: Any
    finish_reason: FinishReason
    value: Any
    scores: dict[str, float] | None = None      # option scoring: every option's score
    name: str | None = None                     # the call's ``name=``: a capture


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One (batch, sample) row.

    Attributes
    ----------
    tokens : tuple of int
        The row's token ids.
    handle : KVHandle or None
        The stored KV of a prefix of ``tokens`` (None: none yet).
    logprobs : tuple of float or None
        Per token, its log-prob when the model generated it, else None.
    cursors : tuple of Cursor or None
        Per token, the constraint state after it (None outside constrained calls).
    spans : tuple of Span
        The generator calls that produced parts of the row.
    chat : Chat or None
        The conversation, for rows made by ``ss.chat`` (see `Chat`).
    """

    tokens: tuple[int, ...]
    handle: KVHandle | None
    logprobs: tuple[float | None, ...]
    cursors: tuple[Cursor | None, ...]
    spans: tuple[Span, ...] = ()
    chat: Chat | None = None

    @classmethod
    def plain(cls, tokens: Sequence[int]) -> Row:
        """A row of ``tokens`` the model did not generate: no KV yet, no log-probs, no cursors."""
        toks = tuple(tokens)
        return cls(toks, None, (None,) * len(toks), (None,) * len(toks))

    @property
    def last_span(self) -> Span | None:
        return self.spans[-1] if self.spans else None

    def select(self, positions: range, keep_kv: bool) -> Row:
        """The tokens at ``positions`` (a step-1 range or any range), spans clipped and shifted."""
        toks = tuple(self.tokens[i] for i in positions)
        lps = tuple(self.logprobs[i] for i in positions)
        curs = tuple(self.cursors[i] for i in positions)
        handle = None
        if keep_kv and self.handle is not None:
            handle = self.handle.prefix(len(toks))
        spans = []
        if positions.step == 1:
            lo, hi = positions.start, positions.stop
            for span in self.spans:
                if span.end <= lo or span.start >= hi:
                    continue
                cut = dataclasses.replace(span, start=max(span.start, lo) - lo, end=min(span.end, hi) - lo)
                if cut.end - cut.start != span.end - span.start:
                    # a span cut short no longer carries its value (nor a capture: its name
                    # stays only for resume()): it is a different text now
                    cut = dataclasses.replace(cut, value=None, finish_reason=FinishReason.SLICED)
                spans.append(cut)
        chat = None
        if positions.step == 1 and positions.start == 0 and self.chat is not None:
            chat = self.chat.prefix(len(toks))
        return Row(toks, handle, lps, curs, tuple(spans), chat)

    def extended(self, tokens: Sequence[int], logprobs: Sequence[float | None] | None = None,
                 cursors: Sequence[Cursor | None] | None = None, spans: Sequence[Span] = ()) -> Row:
        n = len(tokens)
        shift = len(self.tokens)
        return Row(self.tokens + tuple(tokens), self.handle,
                   self.logprobs + tuple(logprobs if logprobs is not None else [None] * n),
                   self.cursors + tuple(cursors if cursors is not None else [None] * n),
                   self.spans + tuple(dataclasses.replace(s, start=s.start + shift, end=s.end + shift)
                                      for s in spans), self.chat)


@dataclasses.dataclass(frozen=True, slots=True)
class Chat:
    """A row's conversation: closed turns, where each ends, and the open assistant turn.

    The record of a row made by ``ss.chat``; the chat layer's subclass renders turns
    (`turn`, `reply`), which is how ``state.user(...)`` reaches the tokenizer's template.
    """

    messages: tuple[tuple[str, str], ...] = ()   # closed turns: (role, content)
    ends: tuple[int, ...] = ()                  # the row's length after each closed turn
    open_at: int | None = None                  # where the open assistant turn's content begins
    answered: bool = False                      # the open turn was given text (maybe "")

    def prefix(self, n: int) -> Chat | None:
        """The conversation of the row's first ``n`` tokens; None where ``n`` cuts a turn's
        markup (the row is then plain text, not a chat)."""
        if self.open_at is not None and n >= self.open_at:
            return self
        if n == 0:
            return type(self)()
        for k in range(len(self.ends), 0, -1):
            if self.ends[k - 1] == n:
                return type(self)(self.messages[:k], self.ends[:k])
        return None

    def turn(self, state: Any, role: str, content: str | Sequence[str]) -> Any:
        """``state`` with a ``role`` turn of ``content`` on every row (``state.user(...)``)."""
        raise NotImplementedError(f"{type(self).__name__} records cannot render turns; "
                                  "start the conversation with ss.chat(model)")

    def reply(self, state: Any, reply: Any, call: dict[str, Any]) -> Any:
        """``state`` with the assistant's turn: text, or a generator called with ``call``."""
        raise NotImplementedError(f"{type(self).__name__} records cannot render turns; "
                                  "start the conversation with ss.chat(model)")


def not_a_conversation() -> ChatTemplateError:
    """The error for a chat turn on a row that is no conversation."""
    return ChatTemplateError("this state is not a conversation (or was cut inside a turn's "
                             "markup); start one with ss.chat(model), or slice back to a "
                             "turn boundary")


def markup_end(row: Row) -> int:
    """Where the row's text after its chat markup begins (0 for a row that is no chat):
    edits of the row's tail, such as token healing, never reach before it."""
    chat = row.chat
    if chat is None:
        return 0
    if chat.open_at is not None:
        return chat.open_at
    return max(chat.ends[-1], 0) if chat.ends else 0
