"""Generators that take a prompt or a state and return a new ``SequenceState``.

``ss.text``, ``ss.choice``, ``ss.regex``, ``ss.json`` and ``ss.cfg`` build a `Generator`;
``ss.continuous`` wraps an outlines 1.x generator or ``(model, output_type)``.  Each call
constrains only the new suffix, so generators mix freely on one state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Unpack

import torch


from seqstate.call import (CALL_PARAMETERS, DEFAULT_MAX_TOKENS, MAX_CONSTRAINED_TOKENS, Call,
                           CallOptions)
from seqstate.chat import markup_end
from seqstate.constraints import compile as compiled
from seqstate.constraints.healing import HealingCursor, heal_span
from seqstate.constraints.regex import RegexConstraint
from seqstate.engine import RowRequest, RowResult, run
from seqstate.errors import ConstraintError, ContextOverflowError, ModelMismatch, SampleMismatch
from seqstate.models.base import BaseModel as Model
from seqstate.engine.beam import beam_run
from seqstate.progress import progress_bar
from seqstate.sampling.params import BeamSearch
from seqstate.state import Row, SequenceState, Span

__all__ = ["Generator", "text", "choice", "regex", "json", "cfg", "continuous", "final_state"]

Prompt = str | Sequence[str] | SequenceState

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

    def __init__(self, model: Model, constraint: Any = None, name: str = "text") -> None:
        self.model = model
        self.constraint = constraint
        self.name = name

    def __repr__(self) -> str:
        return f"<seqstate {self.name} generator on {self.model.name!r}>"

    # -- prompts ------------------------------------------------------------------------------
    def _state(self, prompt: Prompt) -> SequenceState:
        if isinstance(prompt, SequenceState):
            if prompt.model is not self.model:
                raise ModelMismatch(f"this state was made with {prompt.model!r} but the generator uses "
                                    f"{self.model!r}; build the generator on the state's model")
            if all(r.tokens for r in prompt.rows):
                return prompt
            # an empty row is continued like the empty prompt: from the start token
            return prompt._with_rows([r if r.tokens else self._prompt_row("") for r in prompt.rows])
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"a prompt is a str, a non-empty list of str or a SequenceState, got {prompt!r}")
        rows = [self._prompt_row(t) for t in texts]
        return SequenceState(self.model, tuple(rows), len(rows), 1)

    def _prompt_row(self, text: str) -> Row:
        """A prompt's row; the empty prompt is the model's start token."""
        ids = tuple(self.model.encode_prompt(text))
        return Row(ids, None, (None,) * len(ids), (None,) * len(ids))

    @staticmethod
    def _fork(state: SequenceState, k: int | None) -> SequenceState:
        if k is None or k == state.n_samples:
            return state
        if state.n_samples != 1:
            raise SampleMismatch(f"num_samples={k} asked of a state with {state.n_samples} samples; "
                                 f"pass num_samples=None (or {state.n_samples}) to continue each sample, "
                                 "or slice one sample first (state[:, 0, :])")
        rows = [r for r in state.rows for _ in range(k)]
        return SequenceState(state.model, tuple(rows), state.n_batch, k)

    def _requests(self, state: SequenceState, call: Call, cursors: list,
                  healed: Sequence[str] | None = None) -> list[RowRequest]:
        ctx = self.model.context_length
        reqs = []
        default = DEFAULT_MAX_TOKENS if self.constraint is None else MAX_CONSTRAINED_TOKENS
        for r, cursor, removed in zip(state.rows, cursors, healed or [""] * len(cursors)):
            room = ctx - len(r.tokens)
            want = call.max_tokens if call.max_tokens is not None else min(default, room)
            if want > room or room <= 0:
                raise ContextOverflowError(
                    f"a row of {len(r.tokens)} tokens plus max_tokens={call.max_tokens} exceeds the "
                    f"model's context of {ctx} tokens; shorten the prompt or lower max_tokens")
            reqs.append(RowRequest(r.tokens, want, cursor, call.stops, len(removed)))
        return reqs

    def _healed(self, row: Row) -> tuple[Row, str, Any]:
        """Back up the row's trailing tokens for token healing: (kept row, removed text, cursor)."""
        # a chat's template markup is not the prompt's text: healing re-spells the reply only
        floor = markup_end(row)
        k = heal_span(self.model.vocab, row.tokens[max(floor - 1, 0):])
        if k == 0:
            return row, "", None if self.constraint is None else self.constraint.start()
        removed = self.model.vocab.decode(row.tokens[-k:])
        kept = row.select(range(len(row.tokens) - k), keep_kv=True)
        if self.constraint is None:
            return kept, removed, HealingCursor(self.model.vocab, removed.encode())
        inner = self.constraint
        key = ("healed", removed, id(inner))
        if key not in self.model.constraint_cache:
            self.model.constraint_cache[key] = self._prefixed(inner, removed)
        return kept, removed, self.model.constraint_cache[key].start()

    def _prefixed(self, inner: Any, removed: str) -> Any:
        """``inner`` with the healed text required first (its value parses what follows)."""
        if hasattr(inner, "prefixed"):                     # llguidance grammars and JSON
            return inner.prefixed(removed)
        if not isinstance(inner, RegexConstraint) or inner.pattern.startswith("<"):
            raise ConstraintError("token_healing works with text, regex, choice, json and cfg "
                                  f"generators; this {self.name} generator's constraint cannot "
                                  "be prefixed")
        return RegexConstraint(compiled.escape(removed) + "(" + inner.pattern + ")", self.model,
                               parse=lambda t, n=len(removed): inner.parse(t[n:]))

    def _check_hooks(self, hooks: Sequence[Callable]) -> None:
        """A banned phrase that the constraint forces is an error, found before compute."""
        pattern = getattr(self.constraint, "pattern", "")
        if not pattern or pattern.startswith("<"):
            return
        for hook in hooks:
            forced = getattr(hook, "forced_by", None)
            if forced is not None and forced(pattern):
                raise ConstraintError(f"every text this {self.name} generator can produce contains a "
                                      "banned phrase; relax the constraint or the banned phrases")

    def _prepare(self, prompt: Prompt, call: Call, resume: bool):
        """Rows to run, their requests, span starts (resume) and healed prefixes, before compute."""
        self._check_hooks(call.hooks)
        state = self._fork(self._state(prompt), call.num_samples)
        if resume and call.token_healing:
            raise ValueError("resume() continues tokens already generated; token_healing does not apply")
        rows, cursors, span_starts, healed = [], [], [], []
        for r in state.rows:
            last = r.last_span
            removed = ""
            if resume and last is not None and last.end == len(r.tokens) and (
                    r.cursors[-1] is not None or self._free_text(last)):
                cursor, start = r.cursors[-1], last.start
            elif call.token_healing:
                r, removed, cursor = self._healed(r)
                start = None
            else:
                cursor, start = None if self.constraint is None else self.constraint.start(), None
            rows.append(r)
            cursors.append(cursor)
            span_starts.append(start)
            healed.append(removed)
        state = SequenceState(self.model, tuple(rows), state.n_batch, state.n_samples)
        return state, self._requests(state, call, cursors, healed), span_starts, healed

    def _free_text(self, span: Span) -> bool:
        """Whether ``span`` is free text that this (free-text) generator continues on resume."""
        made = span.generator
        return (self.constraint is None and type(self) is Generator and type(made) is Generator
                and made.constraint is None)

    def _row(self, old: Row, res: RowResult, span_start: int | None, healed: str,
             name: str | None) -> Row:
        cursor = res.cursors[-1] if res.cursors else None
        start = res.start if span_start is None else span_start
        # a resumed span's text runs from where the span began; res.text excludes a stop string
        text = self.model.vocab.decode(res.tokens[start:res.start]) + res.text
        reason = res.finish_reason
        if self.constraint is None:
            value = text[len(healed):]          # a resumed reply's value is the whole reply
        elif reason == "constraint_complete" or (reason == "stop" and cursor is not None
                                                 and cursor.accepting):
            # only a completed constraint has a value: a row cut by max_tokens (or a hook's
            # limit) has none even where its text matches ("66" of [0-9]{1,3} was cut, not
            # chosen).  A value the grammar allows but the schema does not (uniqueItems, ...)
            # is never returned as valid.
            constraint = getattr(cursor, "constraint", None) or self.constraint
            validate = getattr(constraint, "validate", None)
            if validate is not None and validate(text) is not None:
                value, reason = None, "invalid"
            else:
                value = self._parse(cursor, text)
        else:
            value = None
        spans = old.spans if span_start is None else old.spans[:-1]
        if name is None and span_start is not None and old.spans:
            name = old.spans[-1].name                  # a resumed call keeps its capture
        span = Span(start, len(res.tokens), self, reason, value, name=name)
        return Row(res.tokens, res.handle, old.logprobs + res.logprobs, old.cursors + res.cursors,
                   spans + (span,), old.chat)

    def _parse(self, cursor, text: str) -> Any:
        constraint = getattr(cursor, "constraint", None) or self.constraint
        try:
            return constraint.parse(text)
        except Exception:
            return None

    # -- calls --------------------------------------------------------------------------------
    # The keywords are declared once, in ``Call``; ``_call_method`` shows them in each call
    # method's signature and docstring, and ``CallOptions`` types them for IDEs.
    @_call_method
    def __call__(self, prompt: Prompt, **call: Unpack[CallOptions]) -> SequenceState:
        """Generate from ``prompt`` (a str, a list of str, one per batch item, or a state);
        returns the new state."""
        return final_state(self._stream(prompt, Call.of(call), resume=False, chunks=False))

    @_call_method
    async def acall(self, prompt: Prompt, **call: Unpack[CallOptions]) -> SequenceState:
        """``await gen.acall(...)``: the same call from an event loop (it runs on a worker
        thread, so concurrent ``acall`` calls share decode steps like threads do)."""
        checked = Call.of(call)
        return await asyncio.to_thread(
            lambda: final_state(self._stream(prompt, checked, resume=False, chunks=False)))

    @_call_method
    def resume(self, state: SequenceState, **call: Unpack[CallOptions]) -> SequenceState:
        """Continue each row's last generator call exactly where the (sliced) state stands."""
        return final_state(self._stream(state, Call.of(call), resume=True, chunks=False))

    @_call_method
    def stream(self, prompt: Prompt, **call: Unpack[CallOptions]) -> Iterator[Any]:
        """Yield generated text as it is produced; the iterator's return value is the final state.

        Chunks never split a character and never contain text that may still turn out to be the
        start of a stop string (or, for hooks with a ``lookback``, text they may still roll
        back); concatenated, a row's chunks equal its generated text without the stop string.
        A 1x1 state yields ``str`` chunks, a larger one ``(batch, sample, str)`` tuples.
        `final_state()` drains the iterator and returns the state.
        """
        return self._stream(prompt, Call.of(call), resume=False)

    def _beam(self, prompt: Prompt, call: Call, resume: bool) -> SequenceState:
        """Beam search over each batch item's samples; returns up to ``width`` samples each."""
        params = call.sampler
        if call.num_samples not in (None, params.width):
            raise SampleMismatch(f"beam search returns width={params.width} samples per batch item; "
                                 f"got num_samples={call.num_samples} (leave it out)")
        if call.hooks:
            raise ValueError("hooks are not supported with beam search yet; use greedy or multinomial")
        state, requests, span_starts, healed = self._prepare(
            prompt, dataclasses.replace(call, num_samples=None), resume)
        groups = []
        for b in range(state.n_batch):
            beams, seen = [], set()
            for s in range(state.n_samples):
                i = b * state.n_samples + s
                row = state.rows[i]
                if row.tokens in seen:
                    continue
                seen.add(row.tokens)
                weight = sum(lp for lp in row.logprobs if lp is not None)
                length = sum(lp is not None for lp in row.logprobs)
                beams.append((requests[i], weight, length, i))
            groups.append(beams)
        width = max(r.max_new for r in requests)
        with progress_bar(call.progress, width, self.name, "tok") as bar:
            results = final_state(beam_run(self.model, [[g[:3] for g in beams] for beams in groups],
                                           params, None if bar is None else lambda: bar.update(1)))
        samples = min(len(r) for r in results)
        rows = []
        for beams, found in zip(groups, results):
            for res, _, origin in found[:samples]:
                i = beams[origin][3]
                rows.append(self._row(state.rows[i], res, span_starts[i], healed[i], call.name))
        return SequenceState(self.model, tuple(rows), state.n_batch, samples)

    def _stream(self, prompt: Prompt, call: Call, resume: bool, chunks: bool = True):
        if isinstance(call.sampler, BeamSearch):
            return self._beam(prompt, call, resume)       # streams nothing until it is done
        state, requests, span_starts, healed = self._prepare(prompt, call, resume)
        # a call that is not streamed hears from the worker once, when it is done; a progress
        # bar is updated on the worker
        observe = _Chunks(state, [len(h) for h in healed], call) if chunks else _nothing
        with progress_bar(call.progress, sum(r.max_new for r in requests), self.name,
                          "tok") as bar:
            if bar is not None:
                observe = _counting(observe, bar)
            results = yield from run(self.model, requests, call.sampler, call.generator(),
                                     call.hooks, call.max_backtracks, observe, call.speculate)
        rows = [self._row(r, res, st, h, call.name)
                for r, res, st, h in zip(state.rows, results, span_starts, healed)]
        return SequenceState(self.model, tuple(rows), state.n_batch, state.n_samples)


def _nothing(rows) -> tuple:
    return ()


def _counting(observe: Callable, bar: Any) -> Callable:
    """``observe`` that also moves the progress bar to the rows' generated tokens."""
    def both(rows):
        bar.update(sum(len(r.generated) for r in rows) - bar.n)
        return observe(rows)
    return both


class _Chunks:
    """What a stream may show after each step: new text that no stop string or hook can
    still take back.  Runs on the scheduler's worker after every step of the call."""

    def __init__(self, state: SequenceState, healed: list[int], call: Call) -> None:
        self.samples, self.single = state.n_samples, len(state.rows) == 1
        self.healed, self.stops, self.hooks = healed, call.stops, bool(call.hooks)
        self.hold = _rollback_reach(call.hooks)
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


def _rollback_reach(hooks: Sequence[Callable]) -> int | None:
    """How many characters back the hooks may roll back; None when one does not say.

    A hook declares it with a ``lookback`` attribute (``ban_phrases`` does); without one, any
    generated text may still be rolled back, so a stream holds everything until the row ends.
    """
    reach = [getattr(h, "lookback", None) for h in hooks]
    return None if None in reach else max(reach, default=0)


def final_state(stream: Iterator[str]) -> SequenceState:
    """Drain a ``gen.stream(...)`` iterator and return its final state."""
    while True:
        try:
            next(stream)
        except StopIteration as stop:
            return stop.value


# -- constructors ------------------------------------------------------------------------------
def text(model: Model) -> Generator:
    """Free text.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> ss.text(model)("Once upon a time", max_tokens=3).shape
    (1, 1)
    """
    return Generator(model, None, "text")


class ScoredChoice(Generator):
    """``choice(..., method="score")``: rank whole options by their log-prob given the state."""

    def __init__(self, model: Model, options: Any, length_normalize: bool) -> None:
        super().__init__(model, None, "choice(score)")
        self.texts, self.values = compiled.options_of(options)
        self.option_ids = [model.encode(t) for t in self.texts]
        self.length_normalize = length_normalize

    def _stream(self, prompt: Prompt, call: Call, resume: bool, chunks: bool = True):
        if resume:
            raise ValueError("a scored choice has nothing to resume; call it again instead")
        state = self._fork(self._state(prompt), call.num_samples)
        self._requests(state, Call(max_tokens=max(map(len, self.option_ids))), [None] * len(state.rows))
        with self.model.lock, torch.inference_mode():
            scored = self.model.backend.score([r.tokens for r in state.rows], self.option_ids)
        rows = []
        for row, per_option in zip(state.rows, scored):
            scores = {t: (sum(lps) / len(lps) if self.length_normalize else sum(lps))
                      for t, (lps, _) in zip(self.texts, per_option)}
            best = max(range(len(self.texts)), key=lambda j: scores[self.texts[j]])
            lps, handle = per_option[best]
            span = Span(len(row.tokens), len(row.tokens) + len(lps), self, "scored",
                        self.values[best], scores, call.name)
            rows.append(Row(row.tokens + tuple(self.option_ids[best]), handle,
                            row.logprobs + tuple(lps), row.cursors + (None,) * len(lps),
                            row.spans + (span,), row.chat))
        return SequenceState(self.model, tuple(rows), state.n_batch, state.n_samples)
        yield  # a generator function, like Generator._stream: scoring streams nothing


def choice(model: Model, options: Any, *, method: str = "generate",
           length_normalize: bool = True) -> Generator:
    """One of ``options`` (a list of str, a ``Literal[...]`` or an ``Enum``); value is the option.

    ``method="generate"`` (default) decodes under the options' constraint.  ``method="score"``
    ranks every whole option by its log-prob given the state (mean per token with
    ``length_normalize``, else the sum), in one batched prefill; ``state.scores`` holds them.
    """
    if method == "score":
        return ScoredChoice(model, options, length_normalize)
    if method != "generate":
        raise ValueError(f"method must be 'generate' or 'score', got {method!r}")
    return Generator(model, compiled.choice(model, options), "choice")


def regex(model: Model, pattern: str) -> Generator:
    """Text matching ``pattern`` in full."""
    return Generator(model, compiled.regex(model, pattern), "regex")


def json(model: Model, schema: Any, *, whitespace: str = "compact",
         additional_properties: bool = False, key_order: str = "schema") -> Generator:
    """JSON matching ``schema`` (a pydantic model, a dict or a JSON-schema string); value is parsed.

    ``whitespace``: "compact" (at most one space after ``,``/``:``), "pretty" (indented) or
    "flexible" (any JSON whitespace).  ``additional_properties``: whether objects whose
    schema does not say may get keys it does not list.  ``key_order``: "schema" or
    "required_first".  A finished value is validated against the schema with ``jsonschema``;
    one that fails (a keyword only validation checks, such as ``uniqueItems``) finishes with
    ``finish_reason == "invalid"`` and value None.
    """
    return Generator(model, compiled.json_schema(model, schema, whitespace=whitespace,
                                                 additional_properties=additional_properties,
                                                 key_order=key_order), "json")


def cfg(model: Model, grammar: str) -> Generator:
    """Text in the language of a Lark grammar (see ``ss.grammars.load``)."""
    return Generator(model, compiled.cfg(model, grammar), "cfg")


_PY_TYPES = {int: r"-?(0|[1-9][0-9]*)", float: r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
             bool: r"(true|false)"}


def _for_output_type(model: Model, output_type: Any) -> Generator:
    if output_type is None or output_type is str:
        return text(model)
    if isinstance(output_type, type) and output_type in _PY_TYPES:
        return regex(model, _PY_TYPES[output_type])
    if (typing.get_origin(output_type) is typing.Literal
            or (isinstance(output_type, type) and issubclass(output_type, enum.Enum))
            or isinstance(output_type, (list, tuple))):
        return choice(model, output_type)
    kind = type(output_type).__name__
    if kind == "Regex":
        return regex(model, output_type.pattern)
    if kind == "CFG":
        return cfg(model, output_type.definition)
    if kind == "JsonSchema":
        return json(model, output_type.schema)
    return json(model, output_type)


def continuous(generator_or_model: Any, output_type: Any = None) -> Generator:
    """Wrap an outlines 1.x steerable generator, or ``(model, output_type)``, as a seqstate generator.

    ``continuous(model, output_type)`` compiles ``output_type`` with seqstate's own byte-exact
    compilation (str, int, float, bool, Literal, Enum, list of options, pydantic models, dicts,
    outlines ``Regex``/``CFG``/``JsonSchema`` terms).  ``continuous(outlines.Generator(om, T))``
    reuses the generator's compiled index or grammar on the same HF model.
    """
    if isinstance(generator_or_model, Model):
        return _for_output_type(generator_or_model, output_type)
    gen = generator_or_model
    om = getattr(gen, "model", None)
    if om is None or not hasattr(gen, "logits_processor"):
        raise TypeError(f"continuous() takes an outlines steerable Generator or (seqstate model, "
                        f"output_type), got {type(gen).__name__}")
    model = getattr(om, "_seqstate_model", None)
    if model is None:
        from seqstate.models.loading import from_outlines

        model = from_outlines(om)
        om._seqstate_model = model          # the seqstate model (and its KV store) lives with om
    proc = gen.logits_processor
    if proc is None:
        return text(model)
    if hasattr(proc, "index"):
        from seqstate.constraints.regex import RegexConstraint

        return Generator(model, RegexConstraint.from_index(proc.index, model), "outlines")
    if hasattr(proc, "grammar"):
        from seqstate.constraints.grammar import GrammarConstraint

        return Generator(model, GrammarConstraint.from_serialized(proc.grammar, model), "outlines")
    raise TypeError(f"cannot wrap an outlines generator whose processor is {type(proc).__name__}; "
                    "use continuous(model, output_type) instead")
