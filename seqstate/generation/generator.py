"""The `Generator`: a model and a compiled constraint; each call returns a new state.

A call's keywords are declared once, in `seqstate.call.Call`.  A call turns its prompt into
rows (`prompts`), checks what it needs of the engine (`capabilities`), runs them on the
model's runner and records each row's span: where the call's tokens are and their value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Unpack

from seqstate.call import CALL_PARAMETERS, Call, CallOptions
from seqstate.constraints.base import Constraint, Cursor
from seqstate.engine.rows import RowRequest, RowResult
from seqstate.engine.waiting import Caller
from seqstate.errors import ArgumentError, ConstraintError
from seqstate.finish import FinishReason
from seqstate.generation import capabilities, prompts
from seqstate.generation.beam import beam
from seqstate.generation.healing import healed as heal
from seqstate.generation.prompts import Prompt
from seqstate.generation.streaming import (AsyncStream, Chunks, Stream, counting, final_state,
                                          nothing)
from seqstate.hooks import as_hook
from seqstate.models.base import BaseModel as Model
from seqstate.progress import progress_bar
from seqstate.rows import Row, SavedCall, Span
from seqstate.sampling.params import BeamSearch
from seqstate.state import SequenceState

__all__ = ["Generator"]


def _call_method(method: Callable) -> Callable:
    """Show the call keywords (``Call``'s, with types and defaults) in ``method``'s signature
    and their reference in its docstring."""
    sig = inspect.signature(method)
    head = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    method.__signature__ = sig.replace(parameters=head + Call.parameters())
    method.__doc__ = inspect.cleandoc(method.__doc__ or "") + "\n\n" + CALL_PARAMETERS
    return method


class Generator:
    """A reusable generator bound to a model and (optionally) a compiled constraint.

    Call it with a prompt (``str``), a list of prompts (one per batch item) or a
    ``SequenceState``; it returns a new ``SequenceState``.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> yes_no = ss.choice(model, ["yes", "no"])
    >>> yes_no("Answer: ").value in ("yes", "no")
    True
    """

    def __init__(self, model: Model, constraint: Constraint | None = None,
                 name: str = "text") -> None:
        self.model = model
        self.constraint = constraint
        self.name = name

    def __repr__(self) -> str:
        return f"<seqstate {self.name} generator on {self.model.name!r}>"

    # -- calls --------------------------------------------------------------------------------
    # The keywords are declared once, in ``Call``; ``_call_method`` shows them in each call
    # method's signature and docstring, and ``CallOptions`` types them for IDEs.
    @_call_method
    def __call__(self, prompt: Prompt, **call: Unpack[CallOptions]) -> SequenceState:
        """Generate from ``prompt`` (a str, a list of str, one per batch item, or a state);
        returns the new state."""
        checked = Call.of(call)
        return final_state(self._stream(prompt, checked, resume=False, chunks=False,
                                        caller=checked.caller()))

    @_call_method
    async def acall(self, prompt: Prompt, **call: Unpack[CallOptions]) -> SequenceState:
        """``await gen.acall(...)``: the same call from an event loop, without a thread: it
        joins the running batch like any call and the loop runs on while it decodes.
        Cancelling the awaiting task ends the call's rows at the next step and releases what
        they held."""
        checked = Call.of(call)
        return await AsyncStream(lambda caller: self._stream(
            prompt, checked, resume=False, chunks=False, caller=caller), checked).drain()

    @_call_method
    def resume(self, state: SequenceState, **call: Unpack[CallOptions]) -> SequenceState:
        """Continue each row's last generator call exactly where the (sliced) state stands."""
        checked = Call.of(call)
        return final_state(self._stream(state, checked, resume=True, chunks=False,
                                        caller=checked.caller()))

    @_call_method
    async def aresume(self, state: SequenceState, **call: Unpack[CallOptions]) -> SequenceState:
        """``await gen.aresume(state, ...)``: `resume` from an event loop, as `acall` is."""
        checked = Call.of(call)
        return await AsyncStream(lambda caller: self._stream(
            state, checked, resume=True, chunks=False, caller=caller), checked).drain()

    @_call_method
    def stream(self, prompt: Prompt, **call: Unpack[CallOptions]) -> Stream:
        """Yield generated text as it is produced; then ``stream.state`` is the final state
        (also the iterator's return value).

        Chunks never split a character and never contain text that may still turn out to be the
        start of a stop string (or, for hooks with a ``lookback``, text they may still roll
        back); concatenated, a row's chunks equal its generated text without the stop string.
        A 1x1 state yields ``str`` chunks, a larger one ``(batch, sample, str)`` tuples.
        `final_state()` drains the iterator and returns the state.  Closing the stream
        early (or dropping it) ends the call's rows at the next step.

        Examples
        --------
        >>> import seqstate as ss
        >>> stream = ss.text(ss.models.testing.tiny()).stream("Hello", max_tokens=4)
        >>> chunks = list(stream)
        >>> "".join(chunks) == stream.state.generated
        True
        """
        checked = Call.of(call)
        return Stream(self._stream(prompt, checked, resume=False, caller=checked.caller()))

    @_call_method
    def astream(self, prompt: Prompt, **call: Unpack[CallOptions]) -> AsyncStream:
        """``async for chunk in gen.astream(...)``: `stream` from an event loop, without a
        thread: the same chunks and hold-back.  The stream's ``state`` is the final state
        once it has ended; cancelling the task that iterates it (or ``await
        stream.aclose()``) ends the call's rows at the next step.
        """
        checked = Call.of(call)
        return AsyncStream(lambda caller: self._stream(prompt, checked, resume=False,
                                                       caller=caller), checked)

    def _stream(self, prompt: Prompt, call: Call, resume: bool, chunks: bool = True,
                caller: Caller | None = None):
        if isinstance(call.sampler, BeamSearch):          # streams nothing until it is done
            return (yield from beam(self, prompt, call, resume, caller))
        state, requests, span_starts, healed = self._prepare(prompt, call, resume)
        # a call that is not streamed hears from the worker once, when it is done; a progress
        # bar is updated on the worker
        observe = Chunks(state, [len(h) for h in healed], call) if chunks else nothing
        with progress_bar(call.progress, sum(r.max_new for r in requests), self.name,
                          "tok") as bar:
            if bar is not None:
                observe = counting(observe, bar)
            results = yield from self.model.runner.run(
                requests, call.decoding(self.model.device), observe, caller)
        rows = [self._row(r, res, st, h, call.name)
                for r, res, st, h in zip(state.rows, results, span_starts, healed)]
        return SequenceState(self.model, tuple(rows), state.n_batch, state.n_samples)

    # -- before compute -----------------------------------------------------------------------
    def _check_hooks(self, hooks: Sequence[Callable]) -> None:
        """A banned phrase that the constraint forces is an error, found before compute."""
        pattern = None if self.constraint is None else self.constraint.pattern
        if not pattern:
            return
        for hook in hooks:
            if as_hook(hook).forced_by(pattern):
                raise ConstraintError(f"every text this {self.name} generator can produce contains a "
                                      "banned phrase; relax the constraint or the banned phrases")

    def _prepare(self, prompt: Prompt, call: Call, resume: bool
                 ) -> tuple[SequenceState, list[RowRequest], list[int | None], list[str]]:
        """Rows to run, their requests, span starts (resume) and healed prefixes, before compute."""
        self._check_hooks(call.hooks)
        start = prompts.as_state(self.model, prompt)
        state = prompts.fork(start, call.num_samples)
        if state is not start:
            capabilities.check_fork(self.model, state.n_samples)
        capabilities.check_call(self.model, len(state.rows))
        if resume and call.token_healing:
            raise ArgumentError("resume() continues tokens already generated, so there is no "
                                "prompt boundary to heal; got token_healing=True: leave it out "
                                "of resume(), or call the generator on the state to heal")
        rows, cursors, span_starts, healed, replays = [], [], [], [], []
        # one start cursor for every fresh row (made at the first): cursors are immutable, and
        # rows sharing one share the cursors along any path they walk alike
        # (`GrammarCursor.advance`)
        fresh = None
        for r in state.rows:
            last = r.last_span
            removed = ""
            if resume and last is not None and last.end == len(r.tokens):
                self._check_kind(last)
            if resume and last is not None and last.end == len(r.tokens) and (
                    r.cursors[-1] is not None or self._free_text(last)):
                cursor, begin = r.cursors[-1], last.start
            elif resume and last is not None and last.end == len(r.tokens) and self._saved(last):
                cursor, begin = self._replayed(r.tokens[last.start:]), last.start
            elif call.token_healing:
                r, removed, cursor = heal(self.model, self.constraint, self.name, r)
                begin = None
            else:
                if fresh is None and self.constraint is not None:
                    fresh = self.constraint.start()
                cursor, begin = fresh, None
            rows.append(r)
            cursors.append(cursor)
            span_starts.append(begin)
            healed.append(removed)
            replays.append(r.tokens[begin:] if begin is not None and cursor is not None else ())
        state = SequenceState(self.model, tuple(rows), state.n_batch, state.n_samples)
        requests = prompts.requests(state, call, cursors, self.constraint is not None, healed,
                                    replays)
        call.warn_unused()
        return state, requests, span_starts, healed

    def _check_kind(self, span: Span) -> None:
        """`ArgumentError` where ``span``, the call `resume` would continue, was made by
        another kind of generator (resuming it would start a new call unasked)."""
        kind = span.generator.name
        if kind != self.name:
            raise ArgumentError(f"resume() continues the state's last call, a {kind} call, but "
                                f"this is a {self.name} generator; resume it with a {kind} "
                                f"generator, or call this one on the state (gen(state)) to "
                                f"start a new {self.name} call after it")

    def _free_text(self, span: Span) -> bool:
        """Whether ``span`` is free text that this (free-text) generator continues on resume."""
        made = span.generator
        if isinstance(made, SavedCall):
            return (self.constraint is None and type(self) is Generator
                    and not made.constrained)
        return (self.constraint is None and type(self) is Generator and type(made) is Generator
                and made.constraint is None)

    def _saved(self, span: Span) -> bool:
        """Whether ``span`` is a loaded constrained call this constrained generator resumes."""
        made = span.generator
        return (isinstance(made, SavedCall) and made.constrained and self.constraint is not None
                and made.name == self.name)

    def _replayed(self, tokens: Sequence[int]) -> Cursor | None:
        """The cursor after ``tokens`` from the constraint's start: a loaded state's calls
        keep no cursors, and replaying the call's tokens recreates them exactly."""
        cursor = self.constraint.start()
        for token in tokens:
            if cursor is None or (token in self.model.eos_token_ids and cursor.accepting):
                break
            if not cursor.allows(token):
                raise ConstraintError(
                    f"the saved call's tokens are not what this {self.name} generator allows "
                    f"(token {token} refused); resume a loaded state with a generator built "
                    "like the one that made it")
            cursor = cursor.advance(token)
        return cursor

    # -- after compute ------------------------------------------------------------------------
    def _row(self, old: Row, res: RowResult, span_start: int | None, healed: str,
             name: str | None) -> Row:
        cursor = res.cursors[-1] if res.cursors else None
        start = res.start if span_start is None else span_start
        # a resumed span's text runs from where the span began; res.text excludes a stop string
        text = self.model.vocab.decode(res.tokens[start:res.start]) + res.text
        reason = res.finish_reason
        if self.constraint is None:
            value = text[len(healed):]          # a resumed reply's value is the whole reply
        elif reason == FinishReason.CONSTRAINT_COMPLETE or (
                reason == FinishReason.STOP and cursor is not None and cursor.accepting):
            # only a completed constraint has a value: a row cut by max_tokens (or a hook's
            # limit) has none even where its text matches ("66" of [0-9]{1,3} was cut, not
            # chosen).  A value the grammar allows but the schema does not (uniqueItems, ...)
            # is never returned as valid.
            if self._constraint_of(cursor).validate(text) is not None:
                value, reason = None, FinishReason.INVALID
            else:
                value = self._parse(cursor, text)
        else:
            value = None
        spans = old.spans if span_start is None else old.spans[:-1]
        if name is None and span_start is not None and old.spans:
            name = old.spans[-1].name                  # a resumed call keeps its capture
        span = Span(start, len(res.tokens), self, reason, value, name=name,
                    text=text[len(healed):])
        return Row(res.tokens, res.handle, old.logprobs + res.logprobs, old.cursors + res.cursors,
                   spans + (span,), old.chat)

    def _constraint_of(self, cursor: Cursor | None) -> Constraint:
        """The constraint whose value a row's text is: its cursor's (a healed row's is the
        prefixed one), else the generator's."""
        return (None if cursor is None else cursor.compiled()) or self.constraint

    def _parse(self, cursor: Cursor | None, text: str) -> Any:
        try:
            return self._constraint_of(cursor).parse(text)
        except Exception:
            return None
