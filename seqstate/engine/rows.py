"""What the engine takes per call and per row, what it returns per row, and its per-row
bookkeeping during a call."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from functools import cached_property

import torch

from seqstate.constraints.base import Cursor
from seqstate.detokenize import IncrementalDecoder, StopMatcher, TokenVocabulary
from seqstate.finish import FinishReason
from seqstate.backends.base import Handle
from seqstate.hooks import DEFAULT_MAX_BACKTRACKS
from seqstate.sampling.params import Greedy, Sampler

__all__ = ["Decoding", "RowRequest", "RowResult", "LiveRow"]


@dataclasses.dataclass(frozen=True, slots=True)
class Decoding:
    """How one call's rows are decoded, handed whole from the call down to its `Stepper`.

    What differs per row (token budget, stop strings, constraint cursor, healing) travels in
    each `RowRequest`; a hook's bans live on the row.

    Attributes
    ----------
    sampler : Sampler
        Picks each token from the masked logits (``ss.greedy()`` by default).
    rng : torch.Generator or None
        The call's own random generator (a seeded call's).
    hooks : tuple of callables
        Post-sampling hooks, run in order on every sampled token.
    max_backtracks : int
        Resamples and rollbacks hooks may ask per row before it finishes.
    speculate : bool
        Verify the tokens a constraint forces in one forward, where the engine can.

    Examples
    --------
    >>> import seqstate as ss
    >>> from seqstate.engine import Decoding
    >>> Decoding(ss.multinomial(), hooks=[len]).hooks
    (<built-in function len>,)
    """

    sampler: Sampler = Greedy()
    rng: torch.Generator | None = None
    hooks: tuple[Callable, ...] = ()
    max_backtracks: int = DEFAULT_MAX_BACKTRACKS
    speculate: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "hooks", tuple(self.hooks))


@dataclasses.dataclass(frozen=True, slots=True)
class RowRequest:
    """One row to continue: its tokens, constraint cursor, token budget and stop strings."""

    tokens: tuple[int, ...]
    max_new: int
    cursor: Cursor | None = None
    stop: StopMatcher | None = None
    healed_chars: int = 0  # leading generated characters that re-spell the prompt (healing)
    replay: tuple[int, ...] = ()   # tokens already generated under ``cursor`` (a resumed call)


@dataclasses.dataclass(frozen=True, slots=True)
class RowResult:
    """One continued row.  ``tokens`` is the whole row; ``tokens[start:]`` is new."""

    tokens: tuple[int, ...]
    start: int
    logprobs: tuple[float | None, ...]        # per new token: the model's own log-prob
    cursors: tuple[Cursor | None, ...]        # per new token: the constraint cursor after it
    finish_reason: FinishReason
    text: str                                 # generated text, without a matched stop string
    handle: Handle | None                     # KV of a prefix of `tokens` (None from a Stepper)


class LiveRow:
    """Mutable per-row bookkeeping inside one engine call; never escapes it."""

    def __init__(self, req: RowRequest, vocab: TokenVocabulary, eos: frozenset[int]) -> None:
        self.req = req
        self.vocab = vocab
        self.eos = eos
        self.tokens = list(req.tokens)
        self.start = len(req.tokens)
        self.cursor = req.cursor
        self.logprobs: list[float | None] = []
        self.cursors: list[Cursor | None] = []
        self.offsets: list[int] = []          # where each generated token starts in `text`
        self.bans: dict[int, set[int]] = {}   # position -> tokens a hook banned there
        self.backtracks = 0
        self.origin = 0                       # which incoming row a beam descends from
        self.decoder = IncrementalDecoder(vocab)
        self.text = ""
        self.respelled = 0                     # leading tokens that only re-spell the prompt
        self.value_end: int | None = None
        self.kv_limit: int | None = None       # a stop-string cut invalidates KV past this
        self.finish_reason: FinishReason | None = None

    def fork(self) -> LiveRow:
        """An independent copy (a beam's child); lists are copied, immutable parts shared."""
        child = object.__new__(LiveRow)
        for name, value in self.__dict__.items():
            setattr(child, name, value)
        for name in ("tokens", "logprobs", "cursors", "offsets"):
            setattr(child, name, list(getattr(self, name)))
        child.bans = {k: set(v) for k, v in self.bans.items()}
        child.decoder = self.decoder.copy()
        return child

    @cached_property
    def prompt_text(self) -> str:
        """The text before this call's first generated token (hooks match across it)."""
        return self.vocab.decode(self.tokens[: self.start])

    def rollback_floor(self, lookback: int | None) -> int:
        """The earliest offset in ``text`` a hook looking ``lookback`` characters back can roll
        back to: the start of the token holding that character (None: anywhere)."""
        if lookback is not None and lookback <= 0:
            return len(self.text)
        pos = 0 if lookback is None else len(self.text) - lookback
        if pos <= 0 or not self.offsets:
            return 0
        return self.offsets[bisect.bisect_right(self.offsets, pos) - 1]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.start:]

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next: not banned here, and allowed by the cursor."""
        banned = self.bans.get(len(self.tokens))
        if banned and token in banned:
            return False
        return self.cursor is None or self.cursor.allows(token)

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.text += self.decoder.flush()

    def accept(self, token: int, logprob: float) -> str:
        """Append a sampled token, apply the stop conditions; returns the new text chunk."""
        if token in self.eos and (self.cursor is None or self.cursor.accepting):
            self.finish(FinishReason.EOS if self.cursor is None
                        else FinishReason.CONSTRAINT_COMPLETE)
            return ""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.cursor is not None:
            self.cursor = self.cursor.advance(token)
        self.cursors.append(self.cursor)
        self.offsets.append(len(self.text))
        chunk = self.decoder.push(token)
        self.text += chunk
        if len(self.text) <= self.req.healed_chars and self.respelled == len(self.generated) - 1:
            self.respelled += 1
        stop = self.req.stop
        if stop is not None and chunk:
            # stop strings match only text after the original prompt (not a healed re-spelling)
            first = max(self.req.healed_chars, len(self.text) - len(chunk) - stop.longest + 1)
            begin, end = stop.find(self.text, first)
            if begin >= 0:
                self._cut_at(begin, end)
                self.finish(FinishReason.STOP)
                return chunk
        if self.cursor is not None and self.cursor.complete:
            self.finish(FinishReason.CONSTRAINT_COMPLETE)
        elif len(self.generated) - self.respelled >= self.req.max_new:
            self.finish(FinishReason.MAX_TOKENS)
        return chunk

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` generated tokens and ban, at the first dropped position, the token
        that stood there.  Cursor, log-probs and detokenizer go back with them."""
        keep = len(self.tokens) - n
        self.bans.setdefault(keep, set()).add(self.tokens[keep])
        del self.tokens[keep:]
        k = keep - self.start
        del self.logprobs[k:], self.cursors[k:]
        del self.offsets[k:]
        self.cursor = self.cursors[-1] if self.cursors else self.req.cursor
        self.decoder = IncrementalDecoder(self.vocab)
        self.text = "".join(self.decoder.push(t) for t in self.generated)
        self.respelled = min(self.respelled, len(self.generated))

    def _cut_at(self, begin: int, end: int) -> None:
        """End the row right after the stop string; the value excludes it.

        Unconstrained rows whose last token runs past the stop string are cut at the character
        and the remainder re-encoded; constrained rows keep whole tokens.
        """
        self.value_end = begin
        if self.cursor is not None:
            return
        gen = self.generated
        k, rest = self.vocab.char_prefix_tokens(gen, end)
        if k == len(gen) and not rest:
            return
        extra = self.vocab.encode(rest) if rest else []
        self.kv_limit = self.start + k
        self.tokens[self.start + k:] = extra
        self.logprobs[k:] = [None] * len(extra)
        self.cursors[k:] = [None] * len(extra)
        self.text = self.text[:end]

    def kv_valid(self, held: int) -> int:
        """How many leading tokens of ``tokens`` have valid KV, of the ``held`` a batch holds."""
        valid = min(held, len(self.tokens) - 1)
        return valid if self.kv_limit is None else min(valid, self.kv_limit)

    def result(self, handle: Handle | None) -> RowResult:
        text = self.text if self.value_end is None else self.text[: self.value_end]
        return RowResult(tuple(self.tokens), self.start, tuple(self.logprobs),
                         tuple(self.cursors), self.finish_reason or FinishReason.MAX_TOKENS,
                         text, handle)

