"""Token healing at a call's start: back up the prompt's last tokens, re-spell them first."""

from __future__ import annotations

from typing import Any

from seqstate.constraints.base import Constraint, Cursor
from seqstate.constraints.healing import HealingCursor, heal_span
from seqstate.errors import ConstraintError
from seqstate.models.base import BaseModel
from seqstate.rows import Row, markup_end

__all__ = ["healed"]


def healed(model: BaseModel, constraint: Constraint | None, name: str,
           row: Row) -> tuple[Row, str, Cursor | None]:
    """``row`` backed up for token healing: (kept row, removed text, the call's first cursor).

    A free-text call re-spells the removed text with a `HealingCursor`; a constrained call
    runs its constraint prefixed by that text (compiled once per text, cached on the model).
    """
    # a chat's template markup is not the prompt's text: healing re-spells the reply only
    floor = markup_end(row)
    k = heal_span(model.vocab, row.tokens[max(floor - 1, 0):])
    if k == 0:
        return row, "", None if constraint is None else constraint.start()
    removed = model.vocab.decode(row.tokens[-k:])
    kept = row.select(range(len(row.tokens) - k), keep_kv=True)
    if constraint is None:
        return kept, removed, HealingCursor(model.vocab, removed.encode())
    key = ("healed", removed, id(constraint))
    if key not in model.constraint_cache:
        model.constraint_cache[key] = _prefixed(constraint, removed, name)
    return kept, removed, model.constraint_cache[key].start()


def _prefixed(constraint: Constraint, removed: str, name: str) -> Any:
    """``constraint`` with the healed text required first (its value parses what follows)."""
    prefixed = constraint.prefixed(removed)
    if prefixed is None:
        raise ConstraintError("token_healing works with text, regex, choice, json and cfg "
                              f"generators; this {name} generator's constraint cannot be "
                              "prefixed")
    return prefixed
