"""Regex constraints (and JSON/choice, compiled to regex) on outlines_core, byte-exact.

The outlines_core ``Vocabulary`` is built from each token's exact bytes, so regexes with
non-ASCII characters work (outlines' own string vocabulary collapses partial UTF-8 tokens).
A cursor is one int per row: the index state.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from outlines_core import Index, Vocabulary

from seqstate.constraints import regex_errors, spec
from seqstate.constraints.base import Constraint, Cursor
from seqstate.errors import ConstraintError

__all__ = ["RegexConstraint", "RegexCursor", "byte_vocabulary", "anchored", "escape"]

_MASK_CACHE = 1024       # allowed-token masks (and drafts) kept per compiled constraint
_DRAFT_WIDTH = 64        # a state allowing more tokens than this forces no text
_DRAFT_BYTES = 256       # longest forced text drafted at once


def byte_vocabulary(model) -> Vocabulary:
    """An outlines_core Vocabulary keyed by exact token bytes, special tokens left out."""
    vocab = model.vocab
    eos = min(model.eos_token_ids)
    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab.token_bytes):
        if i in vocab.special_ids or i in model.eos_token_ids or not b:
            continue
        table.setdefault(b, []).append(i)
    return Vocabulary(eos, table)


_SPECIAL = set("\\.^$|?*+()[]{}-/\"")


def escape(text: str) -> str:
    """Escape regex metacharacters only (outlines_core rejects escapes of ordinary characters)."""
    return "".join("\\" + c if c in _SPECIAL else c for c in text)


def anchored(pattern: str) -> str:
    """``pattern`` as outlines_core must see it so that every string of its language is allowed.

    The automaton underneath uses leftmost-first match semantics: once a higher-priority
    alternative has matched, the threads of lower-priority ones are dropped, so ``cat|catalog``
    would never allow "catalog".  Anchoring at the end of the text means nothing has matched
    until the text ends, which keeps every alternative alive.
    """
    return f"(?:{pattern})$"


def _compile(pattern: str, model) -> tuple[Index, int, dict]:
    """The index of ``anchored(pattern)``, the state a call starts in, and how a server
    builds the same (`Constraint.remote`).

    outlines_core cannot build an end-anchored automaton whose start state already accepts
    (a pattern matching the empty string: ``[a-z]*``, ``(ab)?``).  Such a pattern is compiled
    behind a one-byte sentinel token, and calls start in the state after it.
    """
    vocab = _vocabulary(model)
    try:
        index = Index(anchored(pattern), vocab)
        return index, index.get_initial_state(), {spec.REGEX: anchored(pattern)}
    except Exception as exc:
        if "start state" not in str(exc):
            raise
    byte, token = _sentinel(model)
    regex = f"\\x{byte:02x}" + anchored(pattern)
    index = Index(regex, vocab)
    return (index, index.get_next_state(index.get_initial_state(), token),
            {spec.REGEX: regex, spec.REPLAY: [token]})


def _sentinel(model) -> tuple[int, int]:
    """A control byte that is a token of its own: (byte, token id)."""
    ids = _token_by_bytes(model)
    for byte in range(1, 32):
        token = ids.get(bytes([byte]))
        if token is not None and token not in model.vocab.special_ids:
            return byte, token
    raise ConstraintError("this tokenizer has no one-byte control-character token, which "
                          "seqstate needs to compile a regex that matches the empty string; "
                          "make the pattern require at least one character")


class RegexConstraint(Constraint):
    """A compiled regex over a model's vocabulary: frozen and shared by every row.

    ``pattern`` is None for an index compiled elsewhere (`from_index`): its regex is unknown.
    """

    def __init__(self, pattern: str | None, model, parse: Callable[[str], object] = str,
                 index: Index | None = None) -> None:
        self.pattern = pattern
        self.label = "an outlines index" if pattern is None else f"regex {pattern!r}"
        self._parse = parse
        self.vocab_size = model.vocab.size
        self.eos = sorted(model.eos_token_ids)
        self.model = model
        self._drafts: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        try:
            if index is not None:
                self.index, self.initial = index, index.get_initial_state()
                self._remote = None
            else:
                self.index, self.initial, self._remote = _compile(pattern, model)
        except ConstraintError:
            raise
        except Exception as exc:
            raise ConstraintError(regex_errors.explain(pattern, exc)) from exc
        self._masks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._complete: dict[int, bool] = {}     # per automaton state: bounded by its size

    @classmethod
    def from_index(cls, index: Index, model) -> RegexConstraint:
        """Wrap an index compiled elsewhere (an outlines generator's) on the same tokenizer."""
        return cls(None, model, index=index)

    def start(self) -> RegexCursor:
        return RegexCursor(self, self.initial)

    def remote(self) -> dict | None:
        return self._remote

    def parse(self, text: str) -> object:
        return self._parse(text)

    def prefixed(self, text: str) -> RegexConstraint | None:
        """This regex with ``text`` required first; the value is parsed from the rest."""
        if self.pattern is None:
            return None
        n = len(text)
        return RegexConstraint(escape(text) + "(" + self.pattern + ")", self.model,
                               parse=lambda t: self._parse(t[n:]))

    def mask(self, state: int) -> torch.Tensor:
        m = self._masks.get(state)
        if m is None:
            m = torch.zeros(self.vocab_size, dtype=torch.bool)                  # (V,)
            allowed = self.index.get_allowed_tokens(state) or []
            if allowed:
                m[torch.tensor(allowed, dtype=torch.long)] = True
            final = self.index.is_final_state(state)
            m[self.eos] = final
            self._masks[state] = m
            if len(self._masks) > _MASK_CACHE:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(state)
        return m

    def complete(self, state: int) -> bool:
        """``state`` accepts and no token can follow it (asked after every token: cached)."""
        found = self._complete.get(state)
        if found is None:
            found = False
            if self.index.is_final_state(state):
                m = self.mask(state).clone()
                m[self.eos] = False
                found = not bool(m.any())
            self._complete[state] = found
        return found

    def draft(self, state: int) -> tuple[int, ...]:
        """The canonical tokens of the text every match must continue with from ``state``.

        Walks the automaton while all allowed tokens share a common byte prefix that is a token
        itself, then tokenizes the forced text as the tokenizer would.  The engine verifies
        the draft against the model (speculation); it never forces it.
        """
        found = self._drafts.get(state)
        if found is None:
            found = self._draft(state)
            self._drafts[state] = found
            if len(self._drafts) > _MASK_CACHE:
                self._drafts.popitem(last=False)
        return found

    def _draft(self, state: int) -> tuple[int, ...]:
        token_bytes, index = self.model.vocab.token_bytes, self.index
        by_bytes = _token_by_bytes(self.model)
        forced, s = b"", state
        walk: list[tuple[int, int, int]] = []      # (bytes forced so far, token, next state)
        while len(forced) < _DRAFT_BYTES and not index.is_final_state(s):
            allowed = self.mask(s).clone()
            allowed[self.eos] = False
            ids = allowed.nonzero().flatten().tolist()
            if not ids or len(ids) > _DRAFT_WIDTH:
                break
            common = bytes(_common_prefix([token_bytes[i] for i in ids]))
            token = by_bytes.get(common)
            nxt = None if token is None else index.get_next_state(s, token)
            if nxt is None:
                break
            forced, s = forced + common, nxt
            walk.append((len(forced), token, nxt))
        # A row that stopped inside a character (its last token ended mid-way through one)
        # cannot spell the rest of it as text: those bytes are drafted with the walk's own
        # tokens, when one of them ends exactly where the character does (else no draft).
        # The forced text is then cut to whole characters at its end too.
        head = _partial_head(forced)
        draft, s = [], state
        if head:
            if head not in (end for end, _, _ in walk):
                return ()
            for end, token, nxt in walk:
                if end > head:
                    break
                draft.append(token)
                s = nxt
        text = _whole_characters(forced[head:])
        for token in self.model.encode(text) if text else []:
            s = index.get_next_state(s, token)
            if s is None:
                break
            draft.append(token)
        return tuple(draft)


def _partial_head(data: bytes) -> int:
    """How many leading bytes of ``data`` end a character begun before it (UTF-8
    continuation bytes, at most three)."""
    n = 0
    while n < min(3, len(data)) and 0x80 <= data[n] < 0xC0:
        n += 1
    return n


def _whole_characters(data: bytes) -> str:
    """The longest prefix of ``data`` that is whole UTF-8 characters, decoded."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return data[: exc.start].decode("utf-8")


def _common_prefix(items: list[bytes]) -> bytes:
    first, last = min(items), max(items)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


def _cached(model, key: str, build: Callable) -> Any:
    """``build(model)``, computed once per tokenizer and set of EOS ids: models and engines
    sharing a tokenizer share the table (kept with its `TokenVocabulary`)."""
    return model.vocab.table((key, model.eos_token_ids), lambda: build(model))


def _vocabulary(model) -> Vocabulary:
    return _cached(model, "vocabulary", byte_vocabulary)


def _token_by_bytes(model) -> dict[bytes, int]:
    """The lowest token id spelled by each byte string."""
    return _cached(model, "token-by-bytes", lambda m: {
        b: i for i, b in reversed(list(enumerate(m.vocab.token_bytes))) if b})


@dataclasses.dataclass(frozen=True, slots=True)
class RegexCursor(Cursor):
    constraint: RegexConstraint
    state: int

    def compiled(self) -> RegexConstraint:
        return self.constraint

    def allowed(self) -> torch.Tensor:
        return self.constraint.mask(self.state)

    def allows(self, token: int) -> bool:
        """One transition looked up in the index; EOS where the state is final."""
        if token in self.constraint.eos:
            return self.accepting
        return self.constraint.index.get_next_state(self.state, token) is not None

    def draft(self) -> tuple[int, ...]:
        """Tokens the constraint forces next, canonically tokenized (a speculation draft)."""
        return self.constraint.draft(self.state)

    def advance(self, token: int) -> RegexCursor:
        nxt = self.constraint.index.get_next_state(self.state, token)
        if nxt is None:
            raise ConstraintError(f"token {token} is not allowed by {self.constraint.label} here")
        return RegexCursor(self.constraint, nxt)

    @property
    def accepting(self) -> bool:
        return self.constraint.index.is_final_state(self.state)

    @property
    def complete(self) -> bool:
        return self.constraint.complete(self.state)
