"""Teacher-forced scoring in few forwards: contexts and the tries of their continuations
side by side in rows, under a tree-shaped attention mask.

`seqstate.backends.teacher_forcing.score_pairs` walks a prefix's continuations over the engine's
`Batch` one trie level a forward, after a forward for the prefixes' last tokens and the
prefill's own.  Scoring is bound by forwards, not tokens (a 135M model on a CPU feeds a few
tokens a row at about the cost of one), so here a group of contexts takes one forward:

1. The prefixes that two or more contexts share beyond what is stored are prefilled first,
   each once (`seqstate.backends.hf.prefill.ensure_shared_kv`).
2. Each context is a segment: its own uncached tail (its last token included, whose
   distribution scores every continuation's first token), then the trie of its
   continuations' ``c[:-1]``, one column per trie node.  Segments sit side by side on a row
   (a *line*, at most `LINE_COLUMNS` wide) whose past is the union of their stored paths,
   each stored segment loaded once; in order of their prefixes, a context joins the line
   before it unless the past it adds is more than the columns it feeds.  A 4-D mask lets a
   tail token see its own stored path and the tail before it, and a trie node those, the
   whole tail and its ancestors; positions are explicit.  Logits are kept for each tail's
   last column and its trie's columns only.
3. Lines of like widths form a group (right-aligned, padding within `PADDING` of the
   tokens fed, within the scoring budget: KV columns and logits bytes); each group is one
   forward.  Each tail's KV is stored (the context's own KV, which later calls reuse); the
   trie's is scratch and dropped.

So the tokens through the model are exactly the trie of ``context + continuation[:-1]``,
as on the generic path, in large forwards with little padding.  What the mask cannot
express falls back to the generic path: a model whose attention is neither ``sdpa`` nor
``eager``, a sliding window shorter than a row, a tail longer than a chunk, a context whose
continuations alone exceed the budget, and ``store=True``.  Under a sliding window every
context keeps a line of its own (the window counts columns).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from seqstate.backends import teacher_forcing
from seqstate.backends.base import Scored
from seqstate.backends.hf.buffer import KVBuffer
from seqstate.backends.hf.cache import as_cache
from seqstate.backends.hf.prefill import ensure_shared_kv
from seqstate.backends.hf.store import KVHandle
from seqstate.sampling.functions import check_logprobs, greedy_tokens

__all__ = ["score_packed"]

Pair = tuple[tuple[int, ...], tuple[int, ...]]

# padding a group of rows may add, as a share of the tokens it feeds (rows are right-aligned
# to the group's widest, and a padded column costs what a token does)
PADDING = 0.15
# most columns of one row holding several contexts side by side: every column of a row
# attends over the row's width (masked), so a long row would cost more in attention than
# its bigger matrix products save
LINE_COLUMNS = 256


@dataclass
class _Row:
    """One context's row: its stored past, its tail, the trie of its continuations."""

    prefix: tuple[int, ...]
    handle: KVHandle
    pairs: list[int]                                  # indexes of the distinct pairs
    tokens: list[int] = field(default_factory=list)   # trie nodes' tokens, parents first
    parents: list[int] = field(default_factory=list)  # -1: the tail's last column
    reads: dict[int, list[int]] = field(default_factory=dict)  # pair -> node per token
    nodes: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node

    @property
    def tail(self) -> tuple[int, ...]:
        return self.prefix[self.handle.length:]

    @property
    def width(self) -> int:
        """Columns the row feeds: its tail and its trie."""
        return len(self.prefix) - self.handle.length + len(self.tokens)

    def grow(self, j: int, continuation: tuple[int, ...]) -> None:
        """Add ``continuation``'s ``[:-1]`` to the trie; note where each token is read."""
        at, reads = -1, [-1]
        for token in continuation[:-1]:
            if (at, token) not in self.nodes:
                self.nodes[at, token] = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(at)
            at = self.nodes[at, token]
            reads.append(at)
        self.reads[j] = reads


def _packable(backend: Any, pairs: list[Pair]) -> bool:
    """Whether a 4-D mask means the same to this model as its own causal mask on these rows."""
    cfg = backend.hf_model.config
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    window = _window(backend)
    return not window or all(len(p) + len(c) <= window for p, c in pairs)


def _window(backend: Any) -> int | None:
    """The model's sliding attention window, if it has one."""
    return getattr(backend.hf_model.config.get_text_config(decoder=True), "sliding_window", None)


@dataclass
class _Line:
    """One row of the forward: contexts side by side, each seeing its own stored past.

    The line's past is the union of its contexts' stored paths, each segment once: contexts
    that share a stored prefix share its columns."""

    contexts: list[_Row] = field(default_factory=list)
    spans: dict[int, tuple[Any, int]] = field(default_factory=dict)  # segment -> (seg, columns)
    width: int = 0                              # columns the contexts feed
    kept: int = 0                               # positions whose logits are kept

    @property
    def past(self) -> int:
        return sum(hi for _, hi in self.spans.values())

    def grown(self, row: _Row) -> _Line:
        spans = dict(self.spans)
        for seg, _, hi in row.handle.pieces():
            spans[id(seg)] = (seg, max(hi, spans.get(id(seg), (seg, 0))[1]))
        return _Line(self.contexts + [row], spans, self.width + row.width,
                     self.kept + 1 + len(row.tokens))


def _lines(rows: list[_Row], fits) -> list[_Line]:
    """``rows`` on lines: in order of their prefixes (rows sharing a stored path side by
    side), a row joins the line before it while ``fits(line)`` and the past it adds is no
    more than the columns it feeds (else every column of the line would attend over it)."""
    lines: list[_Line] = []
    for row in sorted(rows, key=lambda r: r.prefix):
        line = lines[-1].grown(row) if lines else None
        if line is None or not fits(line) or line.past - lines[-1].past > row.width:
            lines.append(_Line().grown(row))
        else:
            lines[-1] = line
    return lines


def score_packed(backend: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                 ) -> list[Scored]:
    """`seqstate.backends.teacher_forcing.score_pairs` (``store=False``) in one forward per group of
    contexts (see the module); identical pairs computed once."""
    keys = [(tuple(p), tuple(c)) for p, c in pairs]
    distinct = list(dict.fromkeys(keys))
    if not distinct or not _packable(backend, distinct):
        return teacher_forcing.score_pairs(backend, pairs)
    for prefix, cont in distinct:
        if not prefix or not cont:
            raise ValueError("every prefix and every continuation needs at least one token")
    prefixes = list(dict.fromkeys(p for p, _ in distinct))
    handles = ensure_shared_kv(backend, [p[:-1] for p in prefixes])
    rows = {p: _Row(p, h, []) for p, h in zip(prefixes, handles)}
    for j, (p, c) in enumerate(distinct):
        rows[p].pairs.append(j)
        rows[p].grow(j, c)
    del handles
    done: dict[Pair, Scored] = {}
    packed, rest = [], []
    most = teacher_forcing.rows_per_group(backend)
    for row in rows.values():
        alone = _cost([_Line().grown(row)], backend.vocab_size)
        if len(row.tail) <= teacher_forcing.CHUNK and teacher_forcing.within_budget(alone, most):
            packed.append(row)
        else:
            rest.extend(distinct[j] for j in row.pairs)
    # a sliding window counts columns: there every context keeps a row of its own
    columns = 0 if _window(backend) else LINE_COLUMNS
    lines = _lines(packed, lambda ln: ln.width <= columns
                   and teacher_forcing.within_budget(_cost([ln], backend.vocab_size), most))
    lines.sort(key=lambda ln: (ln.width, ln.past))              # lines of like widths together
    for budgeted in teacher_forcing.budget_groups(
            lines, lambda g: _cost(g, backend.vocab_size), most):
        for group in _even(budgeted):
            for j, got in _score_group(backend, group, distinct):
                done[distinct[j]] = got
    done.update(zip(rest, teacher_forcing.score_pairs(backend, rest)))
    return [done[key] for key in keys]


def _even(lines: list[_Line]) -> Iterator[list[_Line]]:
    """``lines`` (sorted by width) in consecutive groups whose padding stays within
    `PADDING` of their tokens: every padded column costs a whole token's forward."""
    group: list[_Line] = []
    tokens = 0
    for line in lines:
        if group and line.width * (len(group) + 1) > (1 + PADDING) * (tokens + line.width):
            yield group
            group, tokens = [], 0
        group.append(line)
        tokens += line.width
    if group:
        yield group


def _cost(group: list[_Line], vocab: int) -> tuple[int, int, int]:
    """(KV columns, logits bytes, rows) of ``group`` in one forward."""
    past = max(ln.past for ln in group)
    width = max(ln.width for ln in group)
    kept = max(ln.kept for ln in group)
    return len(group) * (past + width), len(group) * kept * 4 * vocab, len(group)


def _score_group(backend: Any, group: list[_Line], pairs: list[Pair]
                 ) -> list[tuple[int, Scored]]:
    """One forward over ``group``'s lines; each tail stored; every pair's log-probs."""
    past = max(ln.past for ln in group)
    width = max(ln.width for ln in group)
    kept = max(ln.kept for ln in group)
    buf = KVBuffer(backend.num_layers, backend.kv_heads, backend.head_dim, len(group),
                   past + width, backend.dtype, backend.device)
    ids = torch.full((len(group), width), backend.pad_token_id, dtype=torch.long)   # (B, T)
    pos = torch.zeros((len(group), width), dtype=torch.long)                        # (B, T)
    see = torch.zeros((len(group), width, past + width), dtype=torch.bool)          # (B, T, P+T)
    see[:, torch.arange(width), past + torch.arange(width)] = True     # padding sees itself
    keep = torch.full((len(group), kept), width - 1, dtype=torch.long)              # (B, K)
    placed = []                                 # (line, context, tail's end, first kept)
    for i, line in enumerate(group):
        at, col = {}, past - line.past          # the line's past, right-aligned: each segment
        for key, (seg, hi) in line.spans.items():                       # once
            buf.load_span(i, seg, 0, hi, col)
            at[key], col = col, col + hi
        col, k = width - line.width, 0          # contexts side by side, right-aligned
        for row in line.contexts:
            for seg, _, hi in row.handle.pieces():                      # its own past only
                see[i, col: col + row.width, at[id(seg)]: at[id(seg)] + hi] = True
            end = _place(row, col, past, ids[i], pos[i], see[i])
            keep[i, k: k + 1 + len(row.tokens)] = torch.arange(end - 1, end + len(row.tokens))
            placed.append((i, row, end, k))
            col, k = end + len(row.tokens), k + 1 + len(row.tokens)
    buf.length = past
    mask = torch.zeros(see.shape, dtype=backend.dtype)
    mask.masked_fill_(~see, torch.finfo(backend.dtype).min)
    device = backend.device
    scratch = backend.store.frozen        # read before the forward: what it computes is scratch
    logits = backend.forward(ids.to(device), mask[:, None].to(device), pos.to(device),
                             as_cache(buf), logits=keep.to(device))             # (B, K, V)
    contexts = [row for ln in group for row in ln.contexts]
    backend.count(prefill_tokens=sum(len(r.tail) - 1 for r in contexts),
                  decode_tokens=sum(1 + len(r.tokens) for r in contexts))
    # in place: a log-softmax per context left holes of every size in the heap, between the
    # tails stored below (the process grew with every context scored); the
    # forward's logits are an inference tensor, written in place only in inference mode
    with torch.inference_mode():
        logprobs = check_logprobs(torch.log_softmax(logits, -1, out=logits))    # (B, K, V)
    best = greedy_tokens(logprobs.flatten(0, 1)).view(logprobs.shape[:2])      # (B, K)
    out = []
    for i, row, end, k in placed:
        for j in row.pairs:
            at = torch.tensor(row.reads[j], device=device) + k + 1  # kept column k: the tail's
            targets = torch.tensor(pairs[j][1], device=device)
            got = logprobs[i, at, targets]
            out.append((j, Scored(tuple(got.tolist()), tuple((best[i, at] == targets).tolist()))))
        backend.store.extend(row.prefix, row.handle.length,
                             buf.take(i, past + end - len(row.tail), past + end),
                             base=row.handle, scratch=scratch)
    return out


def _place(row: _Row, lo: int, past: int, ids: torch.Tensor, pos: torch.Tensor,
           see: torch.Tensor) -> int:
    """Write ``row``'s tail then trie from column ``lo`` of one line (its ``ids`` (T,),
    ``pos`` (T,) and ``see`` (T, P+T)); returns the column after the tail."""
    tail, n = row.tail, len(row.tokens)
    end = lo + len(tail)
    ids[lo:end] = torch.tensor(tail)
    pos[lo:end] = torch.arange(row.handle.length, len(row.prefix))
    see[lo:end, past + lo: past + end] = torch.ones(len(tail), len(tail), dtype=torch.bool).tril()
    see[end: end + n, past + lo: past + end] = True                    # the trie sees the tail
    for k, (parent, token) in enumerate(zip(row.parents, row.tokens)):
        ids[end + k] = token
        if parent >= 0:                            # a node sees its ancestors (parents first)
            see[end + k, past + end: past + end + n] = see[end + parent, past + end: past + end + n]
            pos[end + k] = pos[end + parent] + 1
        else:
            pos[end + k] = len(row.prefix)
        see[end + k, past + end + k] = True
    return end
