"""Teacher-forced scoring over any engine's `Batch`: every prefix computed once, every
continuation fed once, memory bounded by a token budget whatever the number of pairs.

Two phases, both in groups that fit the budget:

1. **Prefixes.**  Each distinct prefix joins a batch (its ``prefix[:-1]`` found in the store
   or prefilled and stored, shared prefixes once), its last token is fed, and that one
   distribution gives every continuation's *first* token (no continuation re-feeds the
   prefix's last token).
   The whole prefix is then stored: it is the rows' own KV, which later calls reuse.
2. **Continuations.**  Each distinct (prefix, continuation) pair with more than one token
   joins a batch borrowing its prefix's stored KV and is fed ``continuation[:-1]`` (in chunks,
   so a tail of any length is exact), the log-softmax read at the continuation's positions
   only.  That KV is scratch: the slot is released, nothing is stored, unless asked.

The budget counts columns of KV a group holds (rows x their longest prefix + feed, as the
HF engine's right-aligned buffer does) and positions of logits alive at once (rows x fed
tokens x vocabulary, in bytes).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from seqstate.backends.base import Handle, Scored
from seqstate.backends.prefixes import common_prefix
from seqstate.sampling.functions import check_logprobs

__all__ = ["score_pairs", "prefix_groups", "store_rows", "budget_groups", "within_budget",
           "rows_per_group", "SCORE_BATCH_TOKENS", "LOGITS_BYTES", "CHUNK"]

SCORE_BATCH_TOKENS = 8192      # KV columns (rows x longest row) one scoring group holds
LOGITS_BYTES = 1 << 28         # float32 logits alive at once (bytes)
CHUNK = 1024                   # most tokens fed to one row in one forward


def budget_groups(items: Sequence[Any], cost: Callable[[list[Any]], tuple[int, int, int]],
            max_rows: int | None) -> Iterator[list[Any]]:
    """Consecutive groups of ``items`` whose ``cost(group)`` = (KV columns, logits bytes,
    rows) stays within the budget (a single item always forms a group)."""
    group: list[Any] = []
    for item in items:
        grown = group + [item]
        if group and not within_budget(cost(grown), max_rows):
            yield group
            grown = [item]
        group = grown
    if group:
        yield group


def within_budget(cost: tuple[int, int, int], max_rows: int | None) -> bool:
    columns, logits, rows = cost
    return (columns <= SCORE_BATCH_TOKENS and logits <= LOGITS_BYTES
            and (max_rows is None or rows <= max_rows))


def rows_per_group(backend: Any) -> int | None:
    """Rows per group: a llama.cpp row needs its own sequence and its prefix a carrier, and
    a third of the sequences stays free for the scheduler's running rows."""
    rows = backend.capabilities.max_rows
    return None if rows is None else max(1, rows // 3)


def prefix_groups(backend: Any, prefixes: Sequence[Sequence[int]]) -> Iterator[list[int]]:
    """Indexes of ``prefixes``, shortest first, in groups whose rows fit the budget."""
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("every prefix needs at least one token")
    vocab_bytes = 4 * backend.vocab_size
    order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))

    def cost(group: list[int]) -> tuple[int, int, int]:
        return len(group) * len(prefixes[group[-1]]), len(group) * vocab_bytes, len(group)

    return budget_groups(order, cost, rows_per_group(backend))


def _last_logprobs(backend: Any, prefixes: Sequence[Sequence[int]],
                   consume: Callable[[int, torch.Tensor], None]) -> None:
    """Feed each prefix's last token once, in one batch; ``consume(i, logprobs)`` gets the
    float32 log-softmax ``(V,)`` after ``prefixes[i]``.  Each prefix is stored whole (as the
    most recently used KV, no handle kept: a prefix evicted before its continuations run is
    prefilled again, never wrong)."""
    rows = [list(p) for p in prefixes]
    batch = backend.batch()
    try:
        slots = batch.add(rows, 1)
        logits = batch.forward(slots, [r[-1] for r in rows])                   # (G, V)
        for i in range(len(rows)):
            consume(i, check_logprobs(logits[i].log_softmax(-1)))
        del logits
        for slot, row in zip(slots, rows):
            batch.commit(slot, row, len(row))
    finally:
        batch.close()


def score_pairs(backend: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                store: bool = False) -> list[Scored]:
    """Teacher-forced log-probs of every ``(prefix, continuation)`` pair (see the module).

    Identical pairs are computed once; each distinct prefix's last token is fed once, and
    its continuations are scored right after it (its KV the most recently stored).  With
    ``store=True`` each ``prefix + continuation[:-1]`` is stored too (unpinned, like any
    cached KV).
    """
    for prefix, cont in pairs:
        if not prefix or not cont:
            raise ValueError("every prefix and every continuation needs at least one token")
    keys = [(tuple(p), tuple(c)) for p, c in pairs]
    distinct = list(dict.fromkeys(keys))
    prefixes = list(dict.fromkeys(p for p, _ in distinct))
    index = {p: i for i, p in enumerate(prefixes)}
    by_prefix: list[list[int]] = [[] for _ in prefixes]
    for j, (p, _) in enumerate(distinct):
        by_prefix[index[p]].append(j)
    lps: list[list[float]] = [[] for _ in distinct]
    top: list[list[bool]] = [[] for _ in distinct]
    for group in prefix_groups(backend, prefixes):
        def first(k: int, logprobs: torch.Tensor, group: list[int] = group) -> None:
            best = int(logprobs.argmax())
            for j in by_prefix[group[k]]:
                token = distinct[j][1][0]
                lps[j].append(float(logprobs[token]))
                top[j].append(token == best)

        _last_logprobs(backend, [prefixes[i] for i in group], first)
        longer = [[j for j in by_prefix[i] if len(distinct[j][1]) > 1] for i in group]
        _continuations(backend, distinct, [js for js in longer if js], lps, top, store)
    done = {key: Scored(tuple(lps[j]), tuple(top[j])) for j, key in enumerate(distinct)}
    return [done[key] for key in keys]


def _continuations(backend: Any, pairs: list[tuple[tuple[int, ...], tuple[int, ...]]],
                   todo: list[list[int]], lps: list[list[float]], top: list[list[bool]],
                   store: bool) -> None:
    """Feed ``c[:-1]`` after each pair's stored prefix, reading the log-prob of ``c[1:]``;
    ``todo`` holds the pairs of each prefix.

    Continuations of one prefix are walked as a trie: a slot feeds the run of tokens its
    continuations share (in chunks), then forks where they part, so a shared part is fed
    once (" the city of Paris" and " the city of Lyon" feed " the city of" once).  So a
    prefix's continuations share one group unless they alone exceed the budget (`_pieces`
    then cuts them where they share least): " a barometer" and " a thermometer" in two
    groups would feed " a" twice."""
    vocab_bytes = 4 * backend.vocab_size
    max_rows = rows_per_group(backend)

    def cost(group: list[int]) -> tuple[int, int, int]:
        longest = max(len(pairs[j][0]) + len(pairs[j][1]) for j in group)
        fed = min(max(len(pairs[j][1]) - 1 for j in group), CHUNK)
        return len(group) * longest, len(group) * fed * vocab_bytes, len(group)

    pieces = [piece for js in todo for piece in _pieces(pairs, js, cost, max_rows)]
    for part in budget_groups(pieces, lambda ps: cost([j for p in ps for j in p]), max_rows):
        group = [j for piece in part for j in piece]
        chunk = max(1, min(CHUNK, LOGITS_BYTES // (len(group) * vocab_bytes)))
        members: dict[tuple[int, ...], list[int]] = {}
        for j in group:
            members.setdefault(pairs[j][0], []).append(j)
        batch = backend.batch()
        try:
            # a slot per prefix holding its KV (the row's last token is not fed: any will do)
            slots = batch.add([list(p) + [pairs[js[0]][1][0]] for p, js in members.items()],
                              max(len(pairs[j][1]) for j in group))
            work = [(slot, 0, js) for slot, js in zip(slots, members.values())]
            while work:
                work = _feed(batch, pairs, _split(batch, pairs, work, chunk, store), lps, top)
        finally:
            batch.close()


def _pieces(pairs: list, js: list[int], cost: Callable[[list[int]], tuple[int, int, int]],
            max_rows: int | None) -> list[list[int]]:
    """The continuations ``js`` of one prefix in groups within the budget (one group where
    they fit).  The tokens two neighbours in token order share are fed on both sides of a
    cut between them, so each cut goes where they share fewest: between branches of the trie
    nearest its root (nothing is fed twice where branches part at their first token)."""
    order = sorted(js, key=lambda j: pairs[j][1])
    shared = [common_prefix(pairs[a][1][:-1], pairs[b][1][:-1])
              for a, b in itertools.pairwise(order)]
    pieces, start = [], 0
    while start < len(order):
        end = start + 1
        while end < len(order) and within_budget(cost(order[start: end + 1]), max_rows):
            end += 1
        if end < len(order):                     # the latest of the cuts sharing fewest
            end = min(range(end, start, -1), key=lambda k: shared[k - 1])
        pieces.append(order[start:end])
        start = end
    return pieces


def _split(batch: Any, pairs: list, work: list, chunk: int, store: bool) -> list:
    """Each slot's continuations still to feed, grouped by their next token (a fork per
    group but the first), with the run of tokens each group shares: ``(slot, fed, js, run)``.
    Continuations fed to their end are stored here when asked."""
    out = []
    for slot, fed, js in work:
        more: dict[int, list[int]] = {}
        for j in js:
            c = pairs[j][1]
            if fed < len(c) - 1:
                more.setdefault(c[fed], []).append(j)
            elif store:
                tokens = list(pairs[j][0]) + list(c)
                batch.commit(slot, tokens, len(tokens) - 1)
        if not more:
            batch.release(slot)
            continue
        for k, part in enumerate(more.values()):
            own = slot if k == 0 else batch.fork(slot)
            first = pairs[part[0]][1]
            end = min(min(len(pairs[j][1]) - 1 for j in part), fed + chunk)
            run = 1
            while fed + run < end and all(pairs[j][1][fed + run] == first[fed + run] for j in part):
                run += 1
            out.append((own, fed, part, run))
    return out


def _feed(batch: Any, pairs: list, work: list, lps: list[list[float]],
          top: list[list[bool]]) -> list:
    """Feed each slot its shared run in one batch; every member reads its own next tokens'
    log-probs (the run's last position serves tokens that differ)."""
    if not work:
        return []
    feeds = [list(pairs[js[0]][1][fed: fed + run]) for _, fed, js, run in work]
    logits = batch.extend([slot for slot, _, _, _ in work], feeds)
    for (_, fed, js, run), out in zip(work, logits):
        logprobs = check_logprobs(out.log_softmax(-1))                         # (run, V)
        best = logprobs.argmax(-1)
        for j in js:
            targets = torch.tensor(pairs[j][1][fed + 1: fed + 1 + run], device=out.device)
            lps[j].extend(logprobs.gather(1, targets[:, None])[:, 0].tolist())
            top[j].extend((best == targets).tolist())
    return [(slot, fed + run, js) for slot, fed, js, run in work]


def store_rows(backend: Any, rows: Sequence[Sequence[int]]) -> list[Handle]:
    """States' handles on each ``row[:-1]``, stored (computing only what the store lacks):
    a scored choice keeps its winners' KV this way, having scored every option as scratch."""
    batch = backend.batch()
    try:
        slots = batch.add(rows, 0)
        return [batch.commit(slot, row, len(row) - 1) for slot, row in zip(slots, rows)]
    finally:
        batch.close()
