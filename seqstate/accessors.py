"""What a state is indexed and read through besides ``state[key]``: the named-axis
accessors (``state.batch[0]``, ``state.samples[1:3]``, ``state.tokens[:-3]``), character
cuts (``state.chars[:40]``) and named captures (``state["answer"]``).

Each holds the state it reads and calls back into it (`SequenceState._axis`,
``_with_rows``, ``_per_row``), so this module needs no import of `seqstate.state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from seqstate.errors import CaptureNotFound, SlicingError
from seqstate.finish import FinishReason
from seqstate.rows import Row

__all__ = ["Axis", "TokenAxis", "Captures", "Chars"]


class _Indexes:
    """Indexing one axis of ``state`` (``axis``: 0 batch, 1 samples, 2 tokens)."""

    __slots__ = ()
    state: Any                        # the SequenceState indexed
    axis: int

    def __getitem__(self, key: Any) -> Any:
        return self.state._axis(self.axis, key)

    def slice(self, key: Any, *, strict: bool = False) -> Any:
        return self.state._axis(self.axis, key, strict)


class Axis(_Indexes, int):
    """The size of a row axis that also indexes it: ``state.batch[0]``, ``state.samples[1:3]``.

    An int key keeps the axis with size 1, as in ``state[key, :, :]``.
    """

    def __new__(cls, size: int, state: Any, axis: int) -> Axis:
        obj = super().__new__(cls, size)
        obj.state, obj.axis = state, axis
        return obj

    def __repr__(self) -> str:
        return int.__repr__(self)

    def __reduce__(self) -> tuple:
        return (int, (int(self),))


class TokenAxis(_Indexes):
    """``state.tokens[key]``: every row's tokens, whatever the state's shape.

    A prefix slice (``[:n]``, ``[:-k]``) keeps the KV and rolls the constraint state back;
    ``state.tokens.slice(key, strict=True)`` refuses any other slice (its KV would be
    recomputed) with a ``SlicingError``.
    """

    __slots__ = ("state",)
    axis = 2

    def __init__(self, state: Any) -> None:
        self.state = state

    def __len__(self) -> int:
        """The longest row's length."""
        return max((len(r.tokens) for r in self.state.rows), default=0)


class Captures(Mapping):
    """Named calls' values per row; a later call with the same name replaces an earlier one."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state

    def _row(self, row: Row) -> dict[str, Any]:
        return {span.name: span.value for span in row.spans
                if span.name is not None and span.finish_reason != FinishReason.SLICED}

    def __getitem__(self, name: str) -> Any:
        found = [self._row(r) for r in self.state.rows]
        if not any(name in f for f in found):
            raise CaptureNotFound(f"no call named {name!r} in this state; named calls: "
                                  f"{sorted(self) or 'none'} (name one with gen(state, name=...))")
        return self.state._per_row([f.get(name) for f in found])

    def __iter__(self):
        names: dict[str, None] = {}
        for r in self.state.rows:
            names.update(dict.fromkeys(self._row(r)))
        return iter(names)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"Captures({dict(self)!r})"


class Chars:
    """``state.chars[lo:hi]``: character-level cuts of every row (see `SequenceState.chars`)."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state

    def __getitem__(self, key: slice) -> Any:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise SlicingError(f"chars takes a step-1 slice such as state.chars[:40], got {key!r}")
        st = self.state
        vocab = st.model.vocab
        rows = []
        for r in st.rows:
            text = vocab.decode(r.tokens)
            lo, hi, _ = key.indices(len(text))
            if lo == 0:
                k, rest = vocab.char_prefix_tokens(r.tokens, hi)
                rows.append(r.select(range(k), keep_kv=True).extended(st.model.encode(rest)))
            else:
                toks = tuple(st.model.encode(text[lo:hi]))
                rows.append(Row.plain(toks))
        return st._with_rows(rows)
