"""Token healing: back up trailing prompt tokens and make generation reproduce their text.

A prompt ending in a partial word ("The url is http") is cut before the tokens that could merge
with what follows, and the first generated tokens are constrained to spell the removed text
(possibly as one longer token such as " https").  The kept prefix's KV is reused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from seqstate.constraints import spec
from seqstate.constraints.base import Cursor
from seqstate.detokenize import TokenVocabulary

__all__ = ["heal_span", "HealingCursor", "MAX_HEAL_TOKENS"]

MAX_HEAL_TOKENS = 4


def heal_span(vocab: TokenVocabulary, tokens: Sequence[int]) -> int:
    """How many trailing tokens to back up: the most (up to ``MAX_HEAL_TOKENS``, keeping at least
    one token) whose text some single longer token extends."""
    tb = vocab.token_bytes
    best = 0
    for k in range(1, min(MAX_HEAL_TOKENS, len(tokens) - 1) + 1):
        if tokens[-k] in vocab.special_ids:           # never heal into BOS or chat markup
            break
        removed = b"".join(tb[t] for t in tokens[-k:])
        try:
            removed.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if any(len(tb[i]) > len(removed) for i in vocab.ids_with_prefix(removed)):
            best = k
    return best


@dataclasses.dataclass(frozen=True, slots=True)
class HealingCursor(Cursor):
    """Allows only tokens that continue spelling ``remaining``; becomes None once it is spelled."""

    vocab: TokenVocabulary
    remaining: bytes

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab.size, dtype=torch.bool)                       # (V,)
        mask[self.vocab.ids_with_prefix(self.remaining)] = True
        for j in range(1, len(self.remaining)):                   # tokens spelling a part of it
            mask[self.vocab.ids_of(self.remaining[:j])] = True
        return mask

    def remote(self) -> dict:
        return {spec.HEAL: self.remaining.hex()}

    def advance(self, token: int) -> HealingCursor | None:
        b = self.vocab.token_bytes[token]
        if len(b) < len(self.remaining) and self.remaining.startswith(b):
            return HealingCursor(self.vocab, self.remaining[len(b):])
        return None

    @property
    def accepting(self) -> bool:
        return False

    @property
    def complete(self) -> bool:
        return False
