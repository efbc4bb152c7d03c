"""Reading log-probs off a state: ``state.score(continuations)`` and ``state.next_logprobs()``.

Both go through the model's runner to its engine (`seqstate.backends.teacher_forcing`): every row's
KV is found in the store or computed once and stored, the distribution after each row's last
token is computed once, and continuations are fed after their row as scratch KV (not stored
unless ``store=True``), in groups bounded by a token budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqstate.errors import ArgumentError, BatchMismatch, ContextOverflowError

__all__ = ["Scores", "score", "next_logprobs", "row_prefixes"]

Continuation = str | Sequence[int]


@dataclasses.dataclass(frozen=True, slots=True)
class Scores:
    """Teacher-forced log-probs of continuations after every row of a state.

    Every field is nested ``[batch][sample][option]``, options in the order given (a batch
    item scored against its own list has that list's length).

    Attributes
    ----------
    tokens
        each continuation's token ids (a ``str`` encoded as text appended to a state is).
    logprobs
        the log-prob of each of those tokens at its position.
    greedy
        every token of the continuation is the most likely one at its position (greedy
        decoding would produce it).
    options
        the continuations as given (a ``str``, or a tuple of token ids), nested
        ``[batch][option]``: what `best` returns.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> state = ss.from_tokens(model, [model.encode("The sky is")])
    >>> sc = state.score([" blue", " green today"])
    >>> sc.sums.shape
    torch.Size([1, 1, 2])
    >>> len(sc.logprobs[0][0][1]) == len(model.encode(" green today"))
    True
    >>> sc.best()                   # per row: the option of highest summed log-prob
    [[' blue']]
    >>> sc.best_index().tolist()    # the same, as indices into the options
    [[0]]
    """

    tokens: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
    logprobs: tuple[tuple[tuple[tuple[float, ...], ...], ...], ...]
    greedy: tuple[tuple[tuple[bool, ...], ...], ...]
    options: tuple[tuple[Continuation, ...], ...] = ()

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(batch, samples, most options of a batch item)``."""
        return (len(self.tokens), len(self.tokens[0]),
                max(len(options) for item in self.tokens for options in item))

    def _table(self, reduce) -> torch.Tensor:
        out = torch.full(self.shape, math.nan, dtype=torch.float64)
        for b, item in enumerate(self.logprobs):
            for s, options in enumerate(item):
                for o, lps in enumerate(options):
                    out[b, s, o] = reduce(lps)
        return out

    @property
    def sums(self) -> torch.Tensor:
        """Summed log-prob of each continuation, float64 ``(batch, samples, options)``; NaN
        where a batch item has fewer options."""
        return self._table(math.fsum)

    @property
    def means(self) -> torch.Tensor:
        """Mean log-prob per token of each continuation, like `sums` (NaN-padded)."""
        return self._table(lambda lps: math.fsum(lps) / len(lps))

    def best(self, by: str = "sums") -> list[list[Continuation]]:
        """Each row's best option as given (its text, or its token ids), nested
        ``[batch][sample]`` like ``state.value``; by ``"sums"`` (the summed log-prob) or
        ``"means"`` (per token).  `best_index` gives the same choice as indices."""
        index = self.best_index(by).tolist()
        return [[self.options[b][i] for i in row] for b, row in enumerate(index)]

    def best_index(self, by: str = "sums") -> torch.Tensor:
        """The index of each row's best option by ``"sums"`` or ``"means"``, ``(batch,
        samples)`` (padding never wins)."""
        if by not in ("sums", "means"):
            raise ArgumentError(f"by is 'sums' or 'means', got {by!r}")
        table = getattr(self, by)
        return table.nan_to_num(nan=-math.inf).argmax(-1)


def _options(model: Any, n_batch: int, continuations: Any) -> list[list[tuple[int, ...]]]:
    """One list of token-id continuations per batch item, checked before any compute."""
    if isinstance(continuations, str) or not isinstance(continuations, (list, tuple)) \
            or not continuations:
        raise ArgumentError(f"continuations is a non-empty list (of str or token-id lists, or "
                            f"one such list per batch item), got {continuations!r}")

    def per_item(c: Any) -> bool:
        return isinstance(c, (list, tuple)) and bool(c) and all(
            isinstance(x, (str, list, tuple)) for x in c)

    kinds = {per_item(c) for c in continuations}
    if kinds == {True}:
        if len(continuations) != n_batch:
            raise BatchMismatch(f"{len(continuations)} lists of continuations for a state of "
                                f"{n_batch} batch items: give one list per batch item, "
                                f"or one list shared by all")
        return [[_encoded(model, c) for c in item] for item in continuations]
    if kinds != {False}:
        raise ArgumentError("continuations mixes lists of continuations with continuations: "
                            "give one list shared by every row, or one list per batch item")
    shared = [_encoded(model, c) for c in continuations]
    return [shared] * n_batch


def _encoded(model: Any, c: Continuation) -> tuple[int, ...]:
    if isinstance(c, str):
        ids = tuple(model.encode(c))
        if not ids:
            raise ArgumentError(f"the continuation {c!r} encodes to no tokens")
        return ids
    if not isinstance(c, (list, tuple)) or not c \
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in c):
        raise ArgumentError(f"a continuation is a str or a non-empty list of token ids, "
                            f"got {c!r}")
    size = model.vocab.size
    bad = [t for t in c if not 0 <= t < size]
    if bad:
        raise ArgumentError(f"token ids {bad[:5]} are outside the vocabulary (0..{size - 1})")
    return tuple(c)


def row_prefixes(model: Any, rows: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Each row's tokens; an empty row is the model's start token, as for generators."""
    start = tuple(model.start_token_ids)
    return [tuple(r) or start for r in rows]


def score(model: Any, rows: Sequence[Sequence[int]], shape: tuple[int, int],
          continuations: Any, *, store: bool = False,
          scorer: Callable[[list], list] | None = None) -> Scores:
    """``state.score``: the state's ``rows`` (token ids, batch-major) of ``shape``.
    ``scorer(pairs)`` scores the ``(prefix, continuation)`` pairs (by default the model's
    runner; `seqstate.activations` gives a hooked one)."""
    n_batch, n_samples = shape
    options = _options(model, n_batch, continuations)
    given = _as_given(continuations, n_batch)
    prefixes = row_prefixes(model, rows)
    limit = model.context_length
    pairs = []
    for i, prefix in enumerate(prefixes):
        for c in options[i // n_samples]:
            if len(prefix) + len(c) - 1 > limit:          # the last token is never fed
                raise ContextOverflowError(
                    f"a row of {len(prefix)} tokens and a continuation of {len(c)} need "
                    f"{len(prefix) + len(c) - 1} positions, past the model's context of "
                    f"{limit} tokens")
            pairs.append((prefix, c))
    scored = iter(model.runner.score(pairs, store=store) if scorer is None else scorer(pairs))
    tokens, logprobs, greedy = [], [], []
    for b in range(n_batch):
        rows_t, rows_l, rows_g = [], [], []
        for _ in range(n_samples):
            done = [next(scored) for _ in options[b]]
            rows_t.append(tuple(options[b]))
            rows_l.append(tuple(s.logprobs for s in done))
            rows_g.append(tuple(s.greedy for s in done))
        tokens.append(tuple(rows_t))
        logprobs.append(tuple(rows_l))
        greedy.append(tuple(rows_g))
    return Scores(tuple(tokens), tuple(logprobs), tuple(greedy), given)


def _as_given(continuations: Any, n_batch: int) -> tuple[tuple[Continuation, ...], ...]:
    """The continuations as the user wrote them, one tuple per batch item (checked by
    `_options` already); token-id lists become tuples."""
    def kept(c: Continuation) -> Continuation:
        return c if isinstance(c, str) else tuple(c)

    if isinstance(continuations[0], (list, tuple)) and continuations[0] \
            and isinstance(continuations[0][0], (str, list, tuple)):
        return tuple(tuple(kept(c) for c in item) for item in continuations)
    return (tuple(kept(c) for c in continuations),) * n_batch


def next_logprobs(model: Any, rows: Sequence[Sequence[int]], shape: tuple[int, int]
                  ) -> torch.Tensor:
    """``state.next_logprobs()``: ``(batch, samples, vocab)`` for the state's ``rows``."""
    return model.runner.next_logprobs(row_prefixes(model, rows)).view(*shape, -1)
