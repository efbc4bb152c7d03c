"""Cursors: a request's constraint rebuilt from its spec, walked token by token.

The constraint's EOS rule is seqstate's: EOS only where the text so far is a complete match,
and only EOS once nothing else can follow.  A constraint that cannot continue (a dead end, or
a constraint that failed to build) allows EOS alone, so the request ends there.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from typing import Any

import torch

from seqstate_vllm.table import table
from seqstate_vllm.wire import ALLOW, BAN, FORCE, GRAMMAR, HEAL, REGEX, REPLAY

__all__ = ["RegexCursor", "GrammarCursor", "HealCursor", "cursor_of", "Request"]

_MASKS = 4096           # allowed-token masks kept per compiled regex

log = logging.getLogger("seqstate_vllm")


@functools.lru_cache(maxsize=64)
def _regex(pattern: str) -> tuple[Any, OrderedDict]:
    from outlines_core import Index

    return Index(pattern, table().regex_vocabulary), OrderedDict()


@functools.lru_cache(maxsize=64)
def _grammar(grammar: str):
    import llguidance

    return llguidance.LLMatcher(table().grammar_tokenizer, grammar, log_level=0)


class RegexCursor:
    """An outlines_core index state; masks cached per state on the compiled regex."""

    def __init__(self, pattern: str) -> None:
        self.index, self.masks = _regex(pattern)
        self.state = self.index.get_initial_state()

    def advance(self, token: int) -> bool:
        if token in table().eos:
            return False
        nxt = self.index.get_next_state(self.state, token)
        if nxt is None:
            return False
        self.state = nxt
        return True

    def allowed(self, width: int) -> torch.Tensor:
        m = self.masks.get(self.state)
        if m is None:
            m = torch.zeros(width, dtype=torch.bool)
            ids = self.index.get_allowed_tokens(self.state) or []
            if ids:
                m[torch.tensor(ids, dtype=torch.long)] = True
            m[table().eos] = self.index.is_final_state(self.state)
            self.masks[self.state] = m
            if len(self.masks) > _MASKS:
                self.masks.popitem(last=False)
        return m


class GrammarCursor:
    """A copy of the compiled grammar's llguidance matcher."""

    def __init__(self, grammar: str) -> None:
        self.matcher = _grammar(grammar).deep_copy()
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())

    def advance(self, token: int) -> bool:
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    def allowed(self, width: int) -> torch.Tensor:
        import numpy as np

        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[: table().size].astype(bool)
        m = torch.zeros(width, dtype=torch.bool)
        m[: bits.shape[0]] = torch.from_numpy(bits)
        m[table().eos] = self.matcher.is_accepting()
        return m


class HealCursor:
    """Tokens that continue spelling ``remaining``; free once it is spelled."""

    def __init__(self, remaining: bytes) -> None:
        self.remaining = remaining

    def advance(self, token: int) -> bool:
        b = table().tokens[token]
        if len(b) < len(self.remaining) and self.remaining.startswith(b):
            self.remaining = self.remaining[len(b):]
        elif b.startswith(self.remaining) or self.remaining.startswith(b):
            self.remaining = b""
        else:
            return False
        return True

    def allowed(self, width: int) -> torch.Tensor | None:
        if not self.remaining:
            return None
        t = table()
        m = torch.zeros(width, dtype=torch.bool)
        ids = [i for i in t.by_prefix.get(self.remaining[:1], ())
               if t.tokens[i].startswith(self.remaining) or self.remaining.startswith(t.tokens[i])]
        if ids:
            m[torch.tensor(ids, dtype=torch.long)] = True
        return m


def cursor_of(spec: dict[str, Any]) -> RegexCursor | GrammarCursor | HealCursor | None:
    """The cursor of the spec's constraint, before any token; None where it has none."""
    if REGEX in spec:
        return RegexCursor(spec[REGEX])
    if GRAMMAR in spec:
        return GrammarCursor(spec[GRAMMAR])
    if HEAL in spec:
        return HealCursor(bytes.fromhex(spec[HEAL]))
    return None


class Request:
    """One request's constraint, kept in step with its live output-token list."""

    def __init__(self, spec: dict[str, Any], output: list[int]) -> None:
        self.output = output
        self.seen = 0
        self.force = [int(t) for t in spec.get(FORCE, ())]
        self.ban = {int(k): [int(i) for i in ids] for k, ids in spec.get(BAN, ())}
        self.allow = {int(k): [int(i) for i in ids] for k, ids in spec.get(ALLOW, ())}
        self.dead = False
        self.cursor: Any = None
        try:
            self.cursor = cursor_of(spec)
            for token in spec.get(REPLAY, ()):
                self._advance(int(token))
        except Exception:
            log.exception("seqstate constraint failed to build; the request ends here")
            self.dead = True

    def _advance(self, token: int) -> None:
        if self.cursor is not None and not self.dead and not self.cursor.advance(token):
            self.dead = True

    def apply(self, row: torch.Tensor) -> None:
        """Walk the tokens generated since the last step, then mask ``row`` (the request's
        logits, in place) to what the next token may be."""
        while self.seen < len(self.output):
            k = self.seen
            if k >= len(self.force):
                self._advance(self.output[k])
            self.seen += 1
        k = len(self.output)
        width = row.shape[0]
        if k < len(self.force):
            keep = torch.zeros(width, dtype=torch.bool)
            keep[self.force[k]] = True
        elif self.dead:
            keep = torch.zeros(width, dtype=torch.bool)
            keep[table().eos] = True
        else:
            keep = None if self.cursor is None else self.cursor.allowed(width)
            if keep is not None and not keep.any():
                keep = torch.zeros(width, dtype=torch.bool)
                keep[table().eos] = True
        if k in self.allow:
            extra = torch.zeros(width, dtype=torch.bool)
            extra[self.allow[k]] = True
            keep = extra if keep is None else keep & extra
        if k in self.ban:
            keep = (torch.ones(width, dtype=torch.bool) if keep is None else keep.clone())
            keep[self.ban[k]] = False
        if keep is not None:
            row.masked_fill_(~keep.to(row.device), float("-inf"))
