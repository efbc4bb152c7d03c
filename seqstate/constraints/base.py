"""The constraint protocol: a compiled constraint (frozen, cached) and its per-row cursors.

Both are small base classes: an implementation subclasses them, gives the abstract members and
overrides the defaults where it can do more (drafts, validation, prefixing, a known regex).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from seqstate.constraints import bitmask

__all__ = ["Cursor", "Constraint"]


class Cursor(ABC):
    """Where one row stands in a constraint.  Immutable: ``advance`` returns a new cursor.

    Cursors are stored per generated token, so slicing a state back k tokens rolls the
    constraint back with the KV (the cursor stored at the new last token is the one to resume).
    """

    __slots__ = ()

    @abstractmethod
    def allowed(self) -> torch.Tensor:
        """Bool mask (V,) of tokens allowed next; EOS ids are allowed when ``accepting``."""

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next: ``allowed()[token]`` (an id past the mask never).
        Cursors that can answer for one token without building the mask override it: a
        greedy step asks this of its best token first."""
        mask = self.allowed()
        return token < mask.shape[0] and bool(mask[token])

    @classmethod
    def fill(cls, cursors: list[Cursor], out: np.ndarray, rows: Sequence[int]) -> None:
        """Write the ``allowed`` masks of several cursors of this class (one step's rows),
        packed (`seqstate.constraints.bitmask`), into ``rows`` of ``out`` (B, W): together,
        where a kind can do better (llguidance fills a batch's masks in parallel).  By
        default each cursor's ``allowed``, packed."""
        for cursor, j in zip(cursors, rows):
            out[j] = bitmask.pack(cursor.allowed(), out.shape[1])

    @abstractmethod
    def advance(self, token: int) -> Cursor | None:
        """The cursor after ``token`` (which must be allowed); None once nothing is constrained."""

    @property
    @abstractmethod
    def accepting(self) -> bool:
        """The text so far is a complete match: generation may stop here."""

    @property
    @abstractmethod
    def complete(self) -> bool:
        """Accepting and no token can follow: generation must stop here."""

    def compiled(self) -> Constraint | None:
        """The compiled constraint this cursor walks (its ``parse`` gives the value); None
        for a cursor of none, such as token healing's."""
        return None

    def draft(self) -> tuple[int, ...]:
        """Tokens every match must continue with, canonically tokenized: a speculation draft
        the engine verifies against the model (never forces).  None known: ``()``."""
        return ()

    def remote(self) -> dict | None:
        """How a server-side constraint (seqstate's vLLM plugin) rebuilds this cursor's
        constraint: its compiled constraint's `Constraint.remote`, after which the server
        replays the tokens generated under it so far.  None: it cannot run in a server."""
        compiled = self.compiled()
        return None if compiled is None else compiled.remote()


class Constraint(ABC):
    """A compiled constraint, shared by every row and cached per (spec, tokenizer).

    Attributes
    ----------
    pattern : str or None
        A regex of exactly the texts the constraint allows, where one is known (None
        otherwise): checks such as a hook's ``forced_by`` analyse it before compute.
    """

    pattern: str | None = None

    @abstractmethod
    def start(self) -> Cursor:
        """The cursor before any generated token."""

    @abstractmethod
    def parse(self, text: str) -> object:
        """The ``value`` of a complete match (the text, an option, parsed JSON...)."""

    def validate(self, text: str) -> str | None:
        """None when the complete match ``text`` is a valid value, else why not.  A check
        the constraint itself cannot make (a JSON schema's ``uniqueItems``); none by default."""
        return None

    def prefixed(self, text: str) -> Constraint | None:
        """This constraint with ``text`` required first, its value parsed from what follows
        (token healing re-spells backed-up prompt text); None when it cannot be prefixed."""
        return None

    def remote(self) -> dict | None:
        """The constraint as a server-side plugin (seqstate's vLLM plugin) builds it, over
        the same token bytes: a spec (`seqstate.constraints.spec`) with ``regex`` (the
        anchored pattern) or ``grammar`` (an llguidance grammar), and ``replay``: tokens a
        cursor walks before its first (a regex's sentinel).  None where it cannot be sent
        (an index compiled elsewhere)."""
        return None
