"""The frozen ``SequenceState``: rows of tokens with their KV, log-probs, cursors and spans."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from seqstate import activations, persist, scores, viz
from seqstate.accessors import Axis, Captures, Chars, TokenAxis
from seqstate.errors import ArgumentError, BatchMismatch, ModelMismatch, SlicingError
from seqstate.indexing import is_prefix, normalize, token_positions
from seqstate.rows import Chat, Row, Span, not_a_conversation

__all__ = ["SequenceState", "Row", "Span", "Axis", "TokenAxis", "Captures"]


def _nested(flat: list, batch: int, samples: int) -> list[list]:
    return [flat[b * samples:(b + 1) * samples] for b in range(batch)]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SequenceState:
    """An immutable batch of token sequences, ``(batch, samples)`` rows, with their KV.

    Build one with a generator (``ss.text(model)("prompt")``), `from_tokens()` or
    ``ss.chat(model)``.  Every operation returns a new state; the KV of shared prefixes is
    shared, never copied.

    Attributes
    ----------
    model
        The model the state's tokens belong to.
    rows
        The ``batch * samples`` rows, batch-major.
    batch, samples
        The sizes of the two row axes (ints).  Indexed, each is also a named-axis accessor:
        ``state.batch[0]`` and ``state.samples[1:3]`` select on that axis whatever the shape.
    tokens
        The token axis accessor: ``state.tokens[:-3]`` drops each row's last 3 tokens on
        every shape (``state[:-3]`` on a 1x4 state drops *samples*; see the indexing rules).

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> s = ss.from_tokens(model, [model.encode("Hello world")])
    >>> s.shape, str(s), str(s.tokens[:1])
    ((1, 1), 'Hello world', 'Hello')
    """

    model: Any
    rows: tuple[Row, ...]
    n_batch: int
    n_samples: int

    def __post_init__(self) -> None:
        if len(self.rows) != self.n_batch * self.n_samples:
            raise ArgumentError(f"a {self.n_batch}x{self.n_samples} state has "
                                f"{self.n_batch * self.n_samples} rows (batch-major), got "
                                f"{len(self.rows)}; build states with ss.from_tokens or a "
                                "generator")

    # -- shape and contents -------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        """``(batch, samples)``."""
        return (self.n_batch, self.n_samples)

    @property
    def batch(self) -> Axis:
        """The number of batch items; ``state.batch[key]`` selects batch items (``state[key, :, :]``)."""
        return Axis(self.n_batch, self, 0)

    @property
    def samples(self) -> Axis:
        """Samples per batch item; ``state.samples[key]`` selects samples (``state[:, key, :]``)."""
        return Axis(self.n_samples, self, 1)

    @property
    def tokens(self) -> TokenAxis:
        """``state.tokens[key]`` indexes every row's tokens (``state[:, :, key]``)."""
        return TokenAxis(self)

    def row(self, b: int, s: int) -> Row:
        """The row of batch item ``b``, sample ``s``."""
        return self.rows[b * self.n_samples + s]

    def _text(self, row: Row) -> str:
        return self.model.vocab.decode(row.tokens)

    @property
    def texts(self) -> list[list[str]]:
        """Full texts, nested ``[batch][sample]``."""
        return _nested([self._text(r) for r in self.rows], self.n_batch, self.n_samples)

    @property
    def token_ids(self) -> list[list[list[int]]]:
        """Token ids, nested ``[batch][sample]`` (no padding: rows keep their lengths)."""
        return _nested([list(r.tokens) for r in self.rows], self.n_batch, self.n_samples)

    @property
    def logprobs(self) -> list[list[list[float | None]]]:
        """Per token log-probs; None where the model did not generate the token."""
        return _nested([list(r.logprobs) for r in self.rows], self.n_batch, self.n_samples)

    @property
    def weights(self) -> torch.Tensor:
        """(batch, samples) sums of the log-probs of generated tokens."""
        flat = [sum(lp for lp in r.logprobs if lp is not None) for r in self.rows]
        return torch.tensor(flat, dtype=torch.float64).reshape(self.n_batch, self.n_samples)

    def _per_row(self, values: list) -> Any:
        return values[0] if len(values) == 1 else _nested(values, self.n_batch, self.n_samples)

    @property
    def captures(self) -> Captures:
        """Named calls' values: ``state.captures["answer"]`` (also ``state["answer"]``), per row
        like `value`; ``None`` for a row without that capture."""
        return Captures(self)

    @property
    def value(self) -> Any:
        """The last generator call's result per row (a scalar for a 1x1 state)."""
        return self._per_row([r.last_span.value if r.last_span else None for r in self.rows])

    @property
    def scores(self) -> Any:
        """Option scores of the last call per row (``choice(..., method="score")``), else None."""
        return self._per_row([r.last_span.scores if r.last_span else None for r in self.rows])

    @property
    def finish_reason(self) -> Any:
        """Why the last call ended per row, a `seqstate.FinishReason` (a `str`: compare it
        with ``"eos"``): stop, eos, max_tokens, constraint_complete, dead_end,
        max_backtracks, invalid (a JSON value that fails its schema), scored or sliced;
        None for a row no call made."""
        return self._per_row([r.last_span.finish_reason if r.last_span else None for r in self.rows])

    @property
    def generated(self) -> Any:
        """The text the last generator call wrote per row, whether or not it parsed (a
        scalar for a 1x1 state); None for a row no call made.

        Where a constrained call did not complete (``max_tokens`` ran out inside a JSON
        string, say) its ``value`` is None but its text is here.  A stop string is not part
        of it (as it is not of ``value``).

        Examples
        --------
        >>> import seqstate as ss
        >>> model = ss.models.testing.tiny()
        >>> s = ss.regex(model, r"[0-9]{6}")("Digits: ", max_tokens=2)
        >>> s.value is None, len(s.generated) > 0
        (True, True)
        """
        return self._per_row([self._generated(r) for r in self.rows])

    def _generated(self, row: Row) -> str | None:
        span = row.last_span
        if span is None:
            return None
        if span.text is not None:
            return span.text
        return self.model.vocab.decode(row.tokens[span.start:span.end])

    def dumps(self) -> bytes:
        """The state as bytes: ``ss.loads(model, data)`` makes it a state again, in this
        process or another, on any engine with the same tokenizer.

        A versioned JSON format that runs no code when read: each row's tokens, log-probs,
        spans (finish reasons, values, option scores, capture names) and conversation record.
        KV is not saved (it is recomputed once from the tokens, when first needed), nor are
        constraint cursors (``gen.resume(state)`` recreates them by replaying the call's
        tokens).  ``pickle`` goes through the same bytes (see `seqstate.restore.loads`).

        Examples
        --------
        >>> import seqstate as ss
        >>> model = ss.models.testing.tiny()
        >>> s = ss.text(model)("Once upon a time", max_tokens=4)
        >>> back = ss.loads(model, s.dumps())
        >>> back == s, back.finish_reason == s.finish_reason
        (True, True)
        """
        return persist.encode_rows(self.model, self.rows, self.shape)

    def __reduce__(self) -> tuple:
        # a model cannot travel in a pickle: the state's bytes do, and ss.loads binds them
        return (persist.SavedState, (self.dumps(),))

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        """Texts, batch-major: b0s0, b0s1, ..., b1s0, ..."""
        return (self._text(r) for r in self.rows)

    def __str__(self) -> str:
        return "\n".join(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceState):
            return NotImplemented
        return self.shape == other.shape and [r.tokens for r in self.rows] == [r.tokens for r in other.rows]

    def __hash__(self) -> int:
        return hash((self.shape, tuple(r.tokens for r in self.rows)))

    def __repr__(self) -> str:
        lines = [f"SequenceState(shape={self.shape}, model={getattr(self.model, 'name', '?')!r}"]
        for i, r in enumerate(self.rows[:8]):
            text = self._text(r)
            preview = text if len(text) <= 60 else text[:25] + " ... " + text[-30:]
            lines.append(f"  [{i // self.n_samples},{i % self.n_samples}] {len(r.tokens):4d} tok  {preview!r}")
        if len(self.rows) > 8:
            lines.append(f"  ... {len(self.rows) - 8} more rows")
        return "\n".join(lines) + ")"

    def _repr_html_(self) -> str:
        return viz.tokens_html(self)

    # -- indexing -----------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> Any:
        """``state[batch, sample, token]`` (see the indexing rules), or ``state["name"]``: the
        named capture's value per row."""
        if isinstance(key, str):
            return self.captures[key]
        return self.slice(key)

    def slice(self, key: Any, *, strict: bool = False) -> SequenceState:
        """``state[key]``; with ``strict=True`` a token slice that cannot keep its KV raises."""
        sel = normalize(key, self.shape)
        prefix = is_prefix(sel.token)
        if strict and not prefix:
            raise SlicingError(f"token key {sel.token!r} is not a prefix slice (start 0, step 1), so "
                               "its KV would be recomputed; use state[..., :n] or strict=False")
        rows = []
        for b in sel.batch:
            for s in sel.samples:
                row = self.row(b, s)
                rows.append(row.select(token_positions(sel.token, len(row.tokens), self.shape), prefix))
        return SequenceState(self.model, tuple(rows), len(sel.batch), len(sel.samples))

    def _axis(self, axis: int, key: Any, strict: bool = False) -> SequenceState:
        full = [slice(None)] * 3
        full[axis] = key
        return self.slice(tuple(full), strict=strict)

    @property
    def chars(self) -> Chars:
        """Character-level cuts: ``state.chars[:40]`` keeps the longest whole-token prefix of the
        first 40 characters and re-encodes the rest."""
        return Chars(self)

    # -- log-probs ----------------------------------------------------------------------------
    def score(self, continuations: Any, *, store: bool = False,
              hooks: activations.Hooks | None = None) -> scores.Scores:
        """Teacher-forced log-probs of ``continuations`` after every row.

        ``continuations`` is one list shared by every row, or one list per batch item (of
        any lengths: each question its own answers).  An item is a ``str`` (encoded as text
        appended to a state is: no special tokens) or a list of token ids (taken verbatim).
        Each row's KV is reused from the store or computed once and stored; its last
        position's distribution scores every continuation's first token; the continuations'
        KV is scratch, not stored, unless ``store=True``.  ``hooks``: see `with_hooks`.

        Returns
        -------
        Scores
            ``tokens``, ``logprobs`` and ``greedy`` nested ``[batch][sample][option]``;
            ``sums`` and ``means`` as float64 ``(batch, samples, options)`` tensors.

        Examples
        --------
        >>> import seqstate as ss
        >>> model = ss.models.testing.tiny()
        >>> questions = ss.from_tokens(model, [model.encode("2+2="),
        ...                                    model.encode("Sky:")])
        >>> sc = questions.score([[" 4", " 5"], [" blue", " red", " wet"]])
        >>> sc.sums.shape, bool(sc.sums[0, 0, 2].isnan())
        (torch.Size([2, 1, 3]), True)
        """
        if hooks is not None:
            return activations.score(self, continuations, hooks, store=store)
        return scores.score(self.model, [r.tokens for r in self.rows], self.shape, continuations,
                            store=store)

    def next_logprobs(self, *, hooks: activations.Hooks | None = None) -> torch.Tensor:
        """Float32 log-softmax of the next token after every row, ``(batch, samples, vocab)``.

        Each row's KV is reused from the store or computed once and stored (an empty row
        means the start token, as for generators).  ``hooks``: see `with_hooks`.

        Examples
        --------
        >>> import seqstate as ss
        >>> model = ss.models.testing.tiny()
        >>> names = ss.from_tokens(model, [model.encode("When Mary and John went,")])
        >>> lp = (names + [" John gave it to", " Mary gave it to"]).next_logprobs()
        >>> lp.shape[:2], bool(lp.exp().sum(-1).sub(1).abs().max() < 1e-4)
        (torch.Size([2, 1]), True)
        """
        if hooks is not None:
            return activations.next_logprobs(self, hooks)
        return scores.next_logprobs(self.model, [r.tokens for r in self.rows], self.shape)

    def run_with_cache(self, names: Sequence[str], *, start: int | None = None
                       ) -> activations.ActivationCache:
        """Activations ``names`` of the positions computed after each row's stored prefix, or
        from ``start`` (0: a full forward); nothing stored.  See `seqstate.activations`."""
        return activations.run_with_cache(self, names, start=start)

    def with_hooks(self, hooks: activations.Hooks, *, start: int | None = None
                       ) -> activations.HookedState:
        """The state with ``hooks`` (``{name: fn(act, pos)}``) on: nothing runs until its
        ``next_logprobs()``, ``score()`` or ``run_with_cache()`` (each a run with the hooks),
        see `seqstate.activations`."""
        return activations.HookedState(self, hooks, start)

    # -- concatenation ------------------------------------------------------------------------
    def _encode_each(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.model.encode(t) for t in texts]

    def __add__(self, other: Any) -> SequenceState:
        if isinstance(other, str):
            toks = self.model.encode(other)
            return self._with_rows([r.extended(toks) for r in self.rows])
        if isinstance(other, SequenceState):
            return _concat(self, other)
        if isinstance(other, (list, tuple)) and all(isinstance(t, str) for t in other):
            state = self._branched(other)
            per_row = state._per_row_texts(other, "strings")
            return state._with_rows([r.extended(t) for r, t in
                                     zip(state.rows, state._encode_each(per_row))])
        return NotImplemented

    def _branched(self, texts: Sequence[Any]) -> SequenceState:
        """A one-item state as one batch item per text of ``texts`` (when there are several;
        the rows are shared, their KV stored once); any other state as it is.  The rule of
        ``state + [...]`` and ``state.user([...])``."""
        if self.n_batch == 1 and isinstance(texts, (list, tuple)) and len(texts) > 1:
            return self._with_rows(list(self.rows) * len(texts), batch=len(texts))
        return self

    def _per_row_texts(self, texts: Sequence[str], what: str) -> list[str]:
        """One text per row from one per batch item or one per row."""
        n = len(texts)
        if n == self.n_batch:
            return [texts[i // self.n_samples] for i in range(len(self.rows))]
        if n == len(self.rows):
            return list(texts)
        raise BatchMismatch(f"cannot add {n} {what} to a state of shape {self.shape}: give "
                            f"{self.n_batch} (one per batch item) or {len(self.rows)} (one per row)")

    def __radd__(self, other: Any) -> SequenceState:
        if isinstance(other, str):
            # a new prompt: the text is encoded as a prompt, and the rows' own prompt start
            # (their BOS) moves in front of it
            toks = tuple(self.model.encode_prompt(other))
            head = Row.plain(toks)
            return self._with_rows([_joined(head, r, self.model.vocab) for r in self.rows])
        return NotImplemented

    def _with_rows(self, rows: Sequence[Row], batch: int | None = None,
                   samples: int | None = None) -> SequenceState:
        return SequenceState(self.model, tuple(rows), batch or self.n_batch, samples or self.n_samples)

    # -- chat ---------------------------------------------------------------------------------
    # A conversation's rows carry the chat layer's record, which renders the turns: the state
    # continues a conversation without knowing how turns are rendered.
    def system(self, content: str | Sequence[str]) -> SequenceState:
        """Append a system turn (the tokenizer's chat template renders it)."""
        return self._conversation().turn(self, "system", content)

    def user(self, content: str | Sequence[str]) -> SequenceState:
        """Append a user turn and open the assistant's; only the new tokens are prefilled.
        A list gives one text per batch item (a one-item conversation branches)."""
        return self._conversation().turn(self, "user", content)

    def assistant(self, reply: Any, **call: Any) -> SequenceState:
        """The assistant's turn: ``reply`` is its text (a str, or one per batch item) or a
        generator, called on the state with ``call``'s keywords (``name=`` captures it)."""
        return self._conversation().reply(self, reply, call)

    def _conversation(self) -> Chat:
        """The chat record that renders this state's next turn."""
        for row in self.rows:
            if row.chat is not None:
                return row.chat
        raise not_a_conversation()

def _broadcast(a: int, b: int, axis: str, sa: tuple, sb: tuple) -> int:
    if a == b or b == 1:
        return a
    if a == 1:
        return b
    raise BatchMismatch(f"cannot concatenate states of shapes {sa} and {sb}: {axis} sizes {a} and {b} "
                        "differ and neither is 1; slice one side to match")


def _concat(left: SequenceState, right: SequenceState) -> SequenceState:
    if left.model is not right.model:
        raise ModelMismatch.between(left.model, right.model, "is concatenated with a state of",
                                    "only states of one model object concatenate; append the "
                                    "other state's text instead (state + other.texts[0][0])")
    batch = _broadcast(left.n_batch, right.n_batch, "batch", left.shape, right.shape)
    samples = _broadcast(left.n_samples, right.n_samples, "sample", left.shape, right.shape)
    rows = []
    for b in range(batch):
        for s in range(samples):
            lr = left.row(b % left.n_batch, s % left.n_samples)
            rr = right.row(b % right.n_batch, s % right.n_samples)
            rows.append(_joined(lr, rr, left.model.vocab))
    return SequenceState(left.model, tuple(rows), batch, samples)


def _joined(left: Row, right: Row, vocab: Any) -> Row:
    """``left`` followed by ``right``'s text: a prompt start (BOS) ``right`` begins with stays
    at the very start of a row, never in its middle."""
    lead = len(right.tokens) - len(vocab.strip_prompt_start(right.tokens))
    if lead:
        right = right.select(range(lead, len(right.tokens)), keep_kv=False)
    return left.extended(right.tokens, right.logprobs, right.cursors, right.spans)
