"""Context-free (Lark) grammar constraints on llguidance.

The grammar is compiled once; a cursor holds an llguidance matcher that is forked with
``deep_copy`` (~1 us) on every advance, so each generated token keeps its own cursor and slicing
back needs no rollback.  llguidance silently enters a permanent error state on a bad token, so
``advance`` checks and raises instead.
"""

from __future__ import annotations

import llguidance
import llguidance.hf
import numpy as np
import torch

from seqstate.errors import ConstraintError

__all__ = ["GrammarConstraint", "GrammarCursor"]


def _tokenizer(model):
    cache = model.constraint_cache
    if ("llguidance-tokenizer",) not in cache:
        cache[("llguidance-tokenizer",)] = llguidance.hf.from_tokenizer(
            model.hf_tokenizer, n_vocab=model.vocab.size, eos_token=min(model.eos_token_ids))
    return cache[("llguidance-tokenizer",)]


class GrammarConstraint:
    """A compiled Lark grammar: frozen and shared by every row."""

    def __init__(self, lark: str, model, parse=str, serialized: str | None = None) -> None:
        self.lark = lark
        self._parse = parse
        self.vocab_size = model.vocab.size
        self.eos = sorted(model.eos_token_ids)
        self.tokenizer = _tokenizer(model)
        self.grammar = serialized or llguidance.LLMatcher.grammar_from_lark(lark)
        error = llguidance.LLMatcher.validate_grammar(self.grammar, self.tokenizer)
        if error:
            raise ConstraintError(f"invalid Lark grammar:\n{error.strip()}\nfix the grammar text "
                                  "(llguidance Lark syntax; the rule `start` is the entry point)")

    @classmethod
    def from_serialized(cls, grammar: str, model) -> GrammarConstraint:
        """Wrap an llguidance grammar already serialized (an outlines generator's)."""
        return cls("<llguidance grammar>", model, serialized=grammar)

    def start(self) -> GrammarCursor:
        return GrammarCursor(self, llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0))

    def parse(self, text: str) -> object:
        return self._parse(text)


class GrammarCursor:
    """An llguidance matcher owned by exactly one generated token; never mutated after."""

    __slots__ = ("constraint", "matcher")

    def __init__(self, constraint: GrammarConstraint, matcher) -> None:
        self.constraint = constraint
        self.matcher = matcher

    def _bits(self) -> np.ndarray:
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(packed, bitorder="little")[: self.constraint.vocab_size]

    def allowed(self) -> torch.Tensor:
        mask = torch.from_numpy(self._bits().astype(bool))                          # (V,)
        mask[self.constraint.eos] = self.accepting
        return mask

    def advance(self, token: int) -> GrammarCursor:
        m = self.matcher.deep_copy()
        if not m.consume_token(token) or m.is_error():
            raise ConstraintError(f"token {token} is not allowed by the grammar here: {m.get_error()}")
        return GrammarCursor(self.constraint, m)

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def complete(self) -> bool:
        return self.matcher.is_stopped() or (self.accepting and not self._can_continue())

    def _can_continue(self) -> bool:
        bits = self._bits()
        bits[self.constraint.eos] = 0
        return bool(bits.any())
