"""Pure key normalisation for ``state[batch, sample, token]``; no torch, no model.

Shortcut rule: axes of size 1 among (batch, samples) may be left out, and the parts given are
read in order over the remaining axes; missing trailing parts select everything.  ``...``
fills the middle as in numpy.  An int keeps its axis (with size 1).
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from typing import Any

from seqstate.errors import SlicingError

__all__ = ["Selection", "normalize", "token_positions", "is_prefix"]

_FULL = slice(None)


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    batch: tuple[int, ...]
    samples: tuple[int, ...]
    token: int | slice


def _forms(shape: tuple[int, int]) -> str:
    b, s = shape
    short = {(True, True): " or state[token]", (True, False): " or state[sample, token]",
             (False, True): " or state[batch, token]"}.get((b == 1, s == 1), "")
    return (f"a state of shape {shape} takes state[batch, sample, token]{short}, with int or "
            "slice parts and at most one `...`")


def _part(key: Any, name: str, shape: tuple[int, int]) -> int | slice:
    """An int (numpy integers included) or a slice of ints with a non-zero step."""
    if isinstance(key, slice):
        bounds = (key.start, key.stop, key.step)
        if not all(b is None or _integral(b) for b in bounds):
            raise SlicingError(f"{name} slice {key!r} has non-integer bounds; {_forms(shape)}")
        if key.step is not None and operator.index(key.step) == 0:
            raise SlicingError(f"{name} slice {key!r} has step 0; use a non-zero step")
        return slice(*(None if b is None else operator.index(b) for b in bounds))
    if not _integral(key):
        raise SlicingError(f"{name} key {key!r} is not an int or a slice; {_forms(shape)}")
    return operator.index(key)


def _integral(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _axis(key: Any, size: int, name: str, shape: tuple[int, int]) -> tuple[int, ...]:
    key = _part(key, name, shape)
    if isinstance(key, slice):
        return tuple(range(size))[key]
    if not -size <= key < size:
        raise SlicingError(f"{name} index {key} is out of range for {size} {name} item(s) "
                           f"(use -{size}..{size - 1}); {_forms(shape)}")
    return (key % size,)


def normalize(key: Any, shape: tuple[int, int]) -> Selection:
    """The (batch rows, sample rows, token key) a user key selects on a state of ``shape``."""
    parts = list(key) if isinstance(key, tuple) else [key]
    if sum(p is Ellipsis for p in parts) > 1:
        raise SlicingError(f"at most one `...` in a key; {_forms(shape)}")
    if Ellipsis in parts:
        i = parts.index(Ellipsis)
        fill = 3 - (len(parts) - 1)
        if fill < 0:
            raise SlicingError(f"too many parts in {key!r}; {_forms(shape)}")
        parts = parts[:i] + [_FULL] * fill + parts[i + 1:]
    if len(parts) > 3:
        raise SlicingError(f"{len(parts)} parts in {key!r}; {_forms(shape)}")
    if len(parts) < 3:
        axes = [a for a, n in (("batch", shape[0]), ("sample", shape[1])) if n > 1] + ["token"]
        if len(parts) > len(axes):
            raise SlicingError(f"{len(parts)} parts in {key!r} but only {len(axes)} axes "
                               f"({', '.join(axes)}) are not of size 1; {_forms(shape)}")
        given = dict(zip(axes, parts))
        parts = [given.get("batch", _FULL), given.get("sample", _FULL), given.get("token", _FULL)]
    batch_key, sample_key, token_key = parts
    batch = _axis(batch_key, shape[0], "batch", shape)
    samples = _axis(sample_key, shape[1], "sample", shape)
    token_key = _part(token_key, "token", shape)
    if not batch or not samples:
        raise SlicingError(f"{key!r} selects no {'batch items' if not batch else 'samples'}; "
                           "a state keeps at least one of each")
    return Selection(batch, samples, token_key)


def is_prefix(token_key: int | slice) -> bool:
    """A slice from 0 with step 1: its KV is a view of the original's."""
    return (isinstance(token_key, slice) and token_key.start in (None, 0)
            and token_key.step in (None, 1))


def token_positions(token_key: int | slice, length: int, shape: tuple[int, int]) -> range:
    """Positions of one row's tokens that ``token_key`` selects (an int must be in range)."""
    if isinstance(token_key, int):
        if not -length <= token_key < length:
            raise SlicingError(f"token index {token_key} is out of range for a row of {length} "
                               f"tokens (use -{length}..{length - 1}); {_forms(shape)}")
        i = token_key % length
        return range(i, i + 1)
    return range(length)[token_key]
