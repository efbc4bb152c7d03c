"""Which position of its row each column of an activation is: what a hook of a hooked run
(`seqstate.activations`) gets beside the activation, and what an `ActivationCache` states."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch

from seqstate.errors import ArgumentError, PrefixPositionError

__all__ = ["Positions"]


@dataclasses.dataclass(frozen=True, eq=False)
class Positions:
    """Which position of its row each column of an activation is.

    Attributes
    ----------
    tensor
        ``(rows, columns)`` long: each column's position in its row, -1 for padding.
    computed
        per row, its first computed position: positions before it are its stored prefix,
        read from the store, in no activation.
    lengths
        per row, its length (positions ``0 .. length - 1``).

    Examples
    --------
    In a hook ``fn(act, pos)``, ``act[pos.at(7)] = value`` patches position 7 of every row.
    Two rows of 5 tokens, the first with 3 stored, the second (left-padded) with 2:

    >>> import torch
    >>> pos = Positions(torch.tensor([[-1, 3, 4], [2, 3, 4]]), (3, 2), (5, 5))
    >>> pos.at(-1).tolist()                        # each row's last token
    [[False, False, True], [False, False, True]]
    >>> pos.at([3, 2]).tolist()                    # one position per row
    [[False, True, False], [True, False, False]]
    >>> try:
    ...     pos.at(2)
    ... except PrefixPositionError as err:
    ...     print(str(err)[:48])
    position 2 of row 0 is in its stored prefix: pos
    """

    tensor: torch.Tensor
    computed: tuple[int, ...]
    lengths: tuple[int, ...]

    def at(self, position: int | Sequence[int]) -> torch.Tensor:
        """A ``(rows, columns)`` boolean mask of ``position`` in every row (negative: from
        each row's end), or of ``position[r]`` in row ``r`` (one per row).
        `seqstate.PrefixPositionError` where a row's position is in its stored prefix: its
        activation was never computed, so no hook can read or change it there;
        `seqstate.ArgumentError` for a position past a row's end or a count of positions
        other than the rows'."""
        try:
            each = [operator.index(position)] * len(self.lengths)
        except TypeError:
            each = [operator.index(p) for p in position]
        if len(each) != len(self.lengths):
            raise ArgumentError(f"{len(each)} positions for {len(self.lengths)} rows: "
                                f"give one int, or one per row")
        wanted = torch.tensor([p + n if p < 0 else p for p, n in zip(each, self.lengths)],
                              device=self.tensor.device)
        for row, (want, first, n) in enumerate(zip(wanted.tolist(), self.computed, self.lengths)):
            if not 0 <= want < n:
                raise ArgumentError(f"position {each[row]} is past the end of row {row}, "
                                    f"whose positions are 0..{n - 1} (-{n}..-1 from its end)")
            if want < first:
                raise PrefixPositionError(
                    f"position {want} of row {row} is in its stored prefix: positions "
                    f"0..{first - 1} were read from the store, not computed, so a hook can "
                    f"neither read nor change them (an earlier call on these tokens stored "
                    f"them: a generator call, score(), or a baseline taken as "
                    f"state.next_logprobs(); take a baseline that stores nothing with "
                    f"state.with_hooks({{}}).next_logprobs()).  Compute them: pass "
                    f"start={want} to the call (the positions from {want} on are computed; "
                    f"start=0 recomputes the whole sequence, a full forward)")
        return self.tensor == wanted[:, None]
