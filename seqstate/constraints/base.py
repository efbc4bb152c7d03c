"""The constraint protocol: a compiled constraint (frozen, cached) and its per-row cursors."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Cursor", "Constraint"]


@runtime_checkable
class Cursor(Protocol):
    """Where one row stands in a constraint.  Immutable: ``advance`` returns a new cursor.

    Cursors are stored per generated token, so slicing a state back k tokens rolls the
    constraint back with the KV (the cursor stored at the new last token is the one to resume).
    """

    def allowed(self) -> torch.Tensor:
        """Bool mask (V,) of tokens allowed next; EOS ids are allowed when ``accepting``."""
        ...

    def advance(self, token: int) -> Cursor:
        """The cursor after ``token`` (which must be allowed)."""
        ...

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match: generation may stop here."""
        ...

    @property
    def complete(self) -> bool:
        """Accepting and no token can follow: generation must stop here."""
        ...


@runtime_checkable
class Constraint(Protocol):
    """A compiled constraint, shared by every row and cached per (spec, tokenizer)."""

    def start(self) -> Cursor:
        """The cursor before any generated token."""
        ...

    def parse(self, text: str) -> object:
        """The ``value`` of a complete match (the text, an option, parsed JSON...)."""
        ...
