"""Grammar constraints on llguidance: Lark grammars, and JSON schemas compiled to grammars.

The grammar is compiled once into a pristine matcher; each row starts from a ``deep_copy`` of it
(cheap), and a cursor forks its matcher on every advance, so each generated token keeps its own
cursor and slicing back needs no rollback.  llguidance silently enters a permanent error state
on a bad token, so ``advance`` checks and raises instead.  Parser limits bound the work of
compiling and of each mask, so a pathological grammar fails or dead-ends instead of hanging.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence

import llguidance
import llguidance.numpy
from llguidance import TokenizerWrapper
import numpy as np
import torch

from seqstate.constraints import bitmask, spec
from seqstate.constraints.base import Constraint, Cursor
from seqstate.errors import ConstraintError

__all__ = ["GrammarConstraint", "GrammarCursor"]


class _Tokens:
    """What llguidance's ``TokenizerWrapper`` reads: seqstate's exact token bytes (so the
    tokenizer's whole JSON is never serialised and parsed again) and its encoder."""

    def __init__(self, vocab, eos: int) -> None:
        self.tokens = vocab.token_bytes
        self.eos_token_id = eos
        self.bos_token_id = vocab.tokenizer.bos_token_id
        # as llguidance's own HF import has it: special tokens and added ``<...>`` tokens are
        # never spelled by text (Gemma's added "\n" tokens are)
        self.special_token_ids = sorted(
            i for i, t in vocab.tokenizer.added_tokens_decoder.items()
            if t.special or (t.content.startswith("<") and t.content.endswith(">")))
        self._encode = vocab.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):          # llguidance probes for a bytes encoder
            raise TypeError("text only")
        return self._encode(text)


def _tokenizer(model) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for ``model``: built once per tokenizer (and EOS), shared by
    every model and engine using it."""
    vocab, eos = model.vocab, min(model.eos_token_ids)
    return vocab.table(("llguidance", eos), lambda: llguidance.LLTokenizer(
        TokenizerWrapper(_Tokens(vocab, eos)), n_vocab=vocab.size))


def _executor(model) -> llguidance.LLExecutor:
    """llguidance's thread pool that fills a batch's masks in parallel (without the GIL):
    one per tokenizer, kept with its vocabulary tables."""
    return model.vocab.table("llguidance-executor", llguidance.LLExecutor)


def _limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits, spelled out: lexer fuel, Earley items per mask, sizes."""
    return llguidance.LLParserLimits(
        max_items_in_row=2_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
        step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000)


def _lark_error(error: str) -> str:
    return (f"invalid Lark grammar:\n{error.strip()}\nfix the grammar text "
            "(llguidance Lark syntax; the rule `start` is the entry point)")


class GrammarConstraint(Constraint):
    """A compiled llguidance grammar: frozen and shared by every row.

    Parameters
    ----------
    lark : str
        Lark grammar text (or a description, when ``serialized`` is given).
    model : Model
        The model whose tokenizer the grammar is compiled for.
    parse : callable, optional
        Turns a complete match into the call's ``value``.
    serialized : str, optional
        An llguidance grammar already built (``LLMatcher.grammar_from_*``), used instead of
        ``lark``.
    validate : callable, optional
        ``validate(text) -> str | None``: a check of a complete match that the grammar cannot
        make; None when valid, else why not.
    describe_error : callable, optional
        Turns llguidance's compile error into the ``ConstraintError`` message.
    """

    def __init__(self, lark: str, model, parse: Callable[[str], object] = str,
                 serialized: str | None = None, *,
                 validate: Callable[[str], str | None] | None = None,
                 describe_error: Callable[[str], str] = _lark_error) -> None:
        self.lark = lark
        self._parse = parse
        self._validate = validate
        self.model = model
        self.vocab_size = model.vocab.size
        self.eos = sorted(model.eos_token_ids)
        self.tokenizer = _tokenizer(model)
        self.executor = _executor(model)
        self.grammar = serialized or llguidance.LLMatcher.grammar_from_lark(lark)
        try:
            self._origin = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0,
                                                limits=_limits())
            error = self._origin.get_error()
        except (ValueError, RuntimeError) as exc:
            error = str(exc)
        if error:
            raise ConstraintError(describe_error(error))

    @classmethod
    def from_serialized(cls, grammar: str, model) -> GrammarConstraint:
        """Wrap an llguidance grammar already serialized (an outlines generator's)."""
        return cls("<llguidance grammar>", model, serialized=grammar)

    def remote(self) -> dict:
        return {spec.GRAMMAR: self.grammar}

    def kept(self, packed: np.ndarray, accepting: Sequence[bool]) -> np.ndarray:
        """llguidance's packed masks (n, >= W) as cursors keep them (n, W), changed in place:
        EOS allowed where the row is ``accepting``, nothing past the vocabulary."""
        packed = packed[:, : bitmask.words(self.vocab_size)]
        bitmask.set_bits(packed, self.eos, False)
        for row, on in zip(packed, accepting):
            if on:
                bitmask.set_bits(row, self.eos, True)
        bitmask.trim(packed, self.vocab_size)
        return packed

    def start(self) -> GrammarCursor:
        return GrammarCursor(self, self._origin.deep_copy())

    def parse(self, text: str) -> object:
        """The value of a complete match; raises ``ValueError`` if ``validate`` rejects it."""
        error = self.validate(text)
        if error is not None:
            raise ValueError(f"the generated text is not valid: {error}")
        return self._parse(text)

    def validate(self, text: str) -> str | None:
        """None when the complete match ``text`` is valid, else a message saying why not."""
        return None if self._validate is None else self._validate(text)

    def prefixed(self, text: str) -> GrammarConstraint:
        """This grammar with ``text`` required first; parse and validate see the rest only.

        Token healing backs up prompt text that the generation must then reproduce.
        """
        try:
            inner = json.loads(self.grammar)
        except ValueError:
            inner = {"grammars": [{"name": "inner", "lark_grammar": self.grammar}]}
        grammars = [dict(g) for g in inner["grammars"]]
        grammars[0]["name"] = grammars[0].get("name") or "inner"
        lark = f"start: {json.dumps(text, ensure_ascii=False)} @{grammars[0]['name']}"
        head = {"name": "prefixed", "lark_grammar": lark}
        n = len(text)
        return GrammarConstraint(
            f"{text!r} + {self.lark}", self.model, lambda t: self._parse(t[n:]),
            json.dumps({**inner, "grammars": [head, *grammars]}),
            validate=None if self._validate is None else lambda t: self._validate(t[n:]))


class GrammarCursor(Cursor):
    """An llguidance matcher owned by exactly one generated token; never advanced in place."""

    __slots__ = ("constraint", "matcher", "_words", "_mask", "_draft", "_forced",
                 "_next", "__weakref__")

    def __init__(self, constraint: GrammarConstraint, matcher) -> None:
        self.constraint = constraint
        self.matcher = matcher
        self._words: np.ndarray | None = None
        self._mask: torch.Tensor | None = None
        self._draft: tuple[int, ...] | None = None
        self._forced: bytes | None = None
        self._next: tuple[int, weakref.ref] | None = None    # the last advance, while it lives

    def compiled(self) -> GrammarConstraint:
        return self.constraint

    def draft(self) -> tuple[int, ...]:
        """The text the grammar forces next (llguidance's fast-forward bytes), tokenized as the
        tokenizer would and cut where the grammar stops accepting the tokens: a speculation
        draft the engine verifies against the model.  It reaches one token further than
        llguidance's own fast-forward tokens, which stop where the next token could merge
        with text the model chooses."""
        if self._draft is None:
            text = self.forced().decode("utf-8", "ignore")
            tokens = self.constraint.model.encode(text) if text else []
            self._draft = tuple(tokens[: self.matcher.validate_tokens(tokens)])
        return self._draft

    def words(self) -> np.ndarray:
        """The allowed tokens as a packed row (`seqstate.constraints.bitmask`), EOS allowed
        where accepting; computed once per cursor (the engine asks for it, then ``complete``
        does), and shared, so callers must not write to it."""
        if self._words is None:
            packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)[None]
            self._words = self.constraint.kept(packed.copy(), [self.accepting])[0]
        return self._words

    def allowed(self) -> torch.Tensor:
        """The allowed tokens (`words` unpacked, once); shared, so callers must not write to
        it."""
        if self._mask is None:
            self._mask = bitmask.unpack(self.words()[None], self.constraint.vocab_size)[0]
        return self._mask

    def forced(self) -> bytes:
        """The bytes the grammar forces next (llguidance's fast-forward bytes)."""
        if self._forced is None:
            self._forced = self.matcher.compute_ff_bytes()
        return self._forced

    def allows(self, token: int) -> bool:
        """One token checked by the matcher unless the mask is known or
        the grammar forces bytes: there the mask also refuses a token that spells only the
        start of a longer one the forced bytes make canonical (``h`` where ``hello``
        follows), which the matcher alone would take."""
        if self._words is None and self.forced():
            self.words()
        if self._words is not None:
            return token < self.constraint.vocab_size and bitmask.has(self._words, token)
        if token in self.constraint.eos:
            return self.accepting
        return token < self.constraint.vocab_size and self.matcher.validate_tokens([token]) == 1

    @classmethod
    def fill(cls, cursors: list[GrammarCursor], out: np.ndarray, rows: Sequence[int]) -> None:
        """The cursors' packed masks into ``rows`` of ``out``: those not known yet computed in
        one parallel llguidance call (it releases the GIL), each kept by its cursor (a cursor
        outlives the step)."""
        todo = list({id(c): c for c in cursors if c._words is None}.values())
        if len(todo) == 1:
            todo[0].words()                  # one row: the matcher's own call, no thread pool
        elif todo:
            first = todo[0].constraint
            fresh = llguidance.numpy.allocate_token_bitmask(len(todo), first.vocab_size)
            llguidance.numpy.fill_next_token_bitmask_par(
                first.executor, [(c.matcher, k) for k, c in enumerate(todo)], fresh)  # (n, W)
            for c, row in zip(todo, first.kept(fresh, [c.accepting for c in todo])):
                c._words = row.copy()       # its own: the batch's other rows may end sooner
        for c, j in zip(cursors, rows):
            n = c._words.shape[0]
            out[j, :n] = c._words
            out[j, n:] = 0

    def advance(self, token: int) -> GrammarCursor:
        """The cursor after ``token``.  The same token from the same cursor gives the same
        cursor while it lives (held weakly): rows that walk one path (a call's rows through
        the text a grammar forces, a prompt's samples) share their cursors, so each mask
        along it is computed once."""
        if self._next is not None and self._next[0] == token:
            known = self._next[1]()
            if known is not None:
                return known
        m = self.matcher.deep_copy()
        if not m.consume_token(token) or m.is_error():
            raise ConstraintError(f"token {token} is not allowed by the grammar here: {m.get_error()}")
        cursor = GrammarCursor(self.constraint, m)
        self._next = (token, weakref.ref(cursor))
        return cursor

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def complete(self) -> bool:
        return self.matcher.is_stopped() or (self.accepting and not self._can_continue())

    def _can_continue(self) -> bool:
        words = self.words().copy()
        bitmask.set_bits(words, self.constraint.eos, False)
        return bool(words.any())
