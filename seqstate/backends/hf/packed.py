"""Teacher-forced scoring in few forwards: each context and the trie of its continuations
in one row, under a tree-shaped attention mask.

`seqstate.backends.scoring.score_pairs` walks a prefix's continuations over the engine's
`Batch` one trie level a forward, after a forward for the prefixes' last tokens and the
prefill's own.  Scoring is bound by forwards, not tokens (a 135M model on a CPU feeds a few
tokens a row at about the cost of one), so here a group of contexts takes one forward:

1. The prefixes that two or more contexts share beyond what is stored are prefilled first,
   each once (`seqstate.backends.hf.prefill.ensure_shared_kv`).
2. Each context is one row: its stored KV as the past, then its own uncached tail (its last
   token included, whose distribution scores every continuation's first token), then the
   trie of its continuations' ``c[:-1]``, one column per trie node (rows right-aligned).
   A 4-D mask lets a tail token see the past and the tail before it, and a trie node the
   past, the whole tail and its ancestors; positions are explicit.  Logits are kept for each
   row's tail's last column and its trie's columns only.
3. Each tail's KV is stored (the context's own KV, which later calls reuse); the trie's is
   scratch and dropped.

So the tokens through the model are exactly the trie of ``context + continuation[:-1]``,
as on the generic path, in one forward per group instead of one per trie level.  Groups keep
the scoring budget (`seqstate.backends.scoring`: KV columns and logits bytes).  What the mask
cannot express falls back to the generic path: a model whose attention is neither ``sdpa``
nor ``eager``, a sliding window shorter than a row, a tail longer than a chunk, a context
whose continuations alone exceed the budget, and ``store=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from seqstate.backends import scoring
from seqstate.backends.base import Scored
from seqstate.backends.hf.buffer import KVBuffer
from seqstate.backends.hf.cache import as_cache
from seqstate.backends.hf.prefill import ensure_shared_kv
from seqstate.backends.hf.store import KVHandle
from seqstate.sampling.functions import check_logprobs

__all__ = ["score_packed"]

Pair = tuple[tuple[int, ...], tuple[int, ...]]


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
    window = getattr(cfg.get_text_config(decoder=True), "sliding_window", None)
    return not window or all(len(p) + len(c) <= window for p, c in pairs)


def score_packed(backend: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                 ) -> list[Scored]:
    """`seqstate.backends.scoring.score_pairs` (``store=False``) in one forward per group of
    contexts (see the module); identical pairs computed once."""
    keys = [(tuple(p), tuple(c)) for p, c in pairs]
    distinct = list(dict.fromkeys(keys))
    if not distinct or not _packable(backend, distinct):
        return scoring.score_pairs(backend, pairs)
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
    for row in rows.values():
        alone = _cost([row], backend.vocab_size)
        if len(row.tail) <= scoring.CHUNK and scoring._fits(alone, scoring._max_rows(backend)):
            packed.append(row)
        else:
            rest.extend(distinct[j] for j in row.pairs)
    packed.sort(key=lambda r: (r.handle.length, len(r.tail) + len(r.tokens)))   # less padding
    for group in scoring._groups(packed, lambda g: _cost(g, backend.vocab_size),
                                 scoring._max_rows(backend)):
        for j, got in _score_group(backend, group, distinct):
            done[distinct[j]] = got
    done.update(zip(rest, scoring.score_pairs(backend, rest)))
    return [done[key] for key in keys]


def _cost(group: list[_Row], vocab: int) -> tuple[int, int, int]:
    """(KV columns, logits bytes, rows) of ``group`` in one forward."""
    past = max(r.handle.length for r in group)
    width = max(len(r.tail) + len(r.tokens) for r in group)
    trie = max(len(r.tokens) for r in group)
    return len(group) * (past + width), len(group) * (trie + 1) * 4 * vocab, len(group)


def _score_group(backend: Any, group: list[_Row], pairs: list[Pair]
                 ) -> list[tuple[int, Scored]]:
    """One forward over ``group``'s rows; each tail stored; every pair's log-probs."""
    past = max(r.handle.length for r in group)
    width = max(len(r.tail) + len(r.tokens) for r in group)
    wc = max(len(r.tokens) for r in group)
    buf = KVBuffer(backend.num_layers, backend.kv_heads, backend.head_dim, len(group),
                   past + width, backend.dtype, backend.device)
    ids = torch.full((len(group), width), backend.pad_token_id, dtype=torch.long)   # (B, T)
    pos = torch.zeros((len(group), width), dtype=torch.long)                        # (B, T)
    see = torch.zeros((len(group), width, past + width), dtype=torch.bool)          # (B, T, P+T)
    see[:, torch.arange(width), past + torch.arange(width)] = True     # padding sees itself
    keep = torch.full((len(group), 1 + wc), width - 1, dtype=torch.long)            # (B, 1+wc)
    ends = []
    for i, row in enumerate(group):
        h, tail, n = row.handle, row.tail, len(row.tokens)
        buf.load(i, h, past)
        end = width - n                             # tail then trie, right-aligned
        lo = end - len(tail)
        ends.append(end)
        ids[i, lo:end] = torch.tensor(tail)
        pos[i, lo:end] = torch.arange(h.length, len(row.prefix))
        see[i, :, past - h.length: past] = True                       # everyone sees the past
        see[i, lo:end, past + lo: past + end] = torch.ones(len(tail), len(tail),
                                                           dtype=torch.bool).tril()
        see[i, end:, past + lo: past + end] = True                 # the trie sees the tail
        keep[i, : 1 + n] = torch.arange(end - 1, width)
        for k, (parent, token) in enumerate(zip(row.parents, row.tokens)):
            ids[i, end + k] = token
            if parent >= 0:                        # a node sees its ancestors (parents first)
                see[i, end + k, past + end: past + width] = see[i, end + parent,
                                                                past + end: past + width]
                pos[i, end + k] = pos[i, end + parent] + 1
            else:
                pos[i, end + k] = len(row.prefix)
            see[i, end + k, past + end + k] = True
    buf.length = past
    mask = torch.zeros(see.shape, dtype=backend.dtype)
    mask.masked_fill_(~see, torch.finfo(backend.dtype).min)
    device = backend.device
    scratch = backend.store.frozen        # read before the forward: what it computes is scratch
    logits = backend.forward(ids.to(device), mask[:, None].to(device), pos.to(device),
                             as_cache(buf), logits=keep.to(device))          # (B, 1 + wc, V)
    backend.count(prefill_tokens=sum(len(r.tail) - 1 for r in group),
                  decode_tokens=sum(1 + len(r.tokens) for r in group))
    out = []
    for i, row in enumerate(group):
        logprobs = check_logprobs(logits[i].log_softmax(-1))                 # (1 + wc, V)
        best = logprobs.argmax(-1)
        for j in row.pairs:
            at = torch.tensor(row.reads[j], device=device) + 1      # kept column 0: the tail's
            targets = torch.tensor(pairs[j][1], device=device)
            got = logprobs[at, targets]
            out.append((j, Scored(tuple(got.tolist()), tuple((best[at] == targets).tolist()))))
        backend.store.extend(row.prefix, row.handle.length,
                             buf.take(i, past + ends[i] - len(row.tail), past + ends[i]),
                             base=row.handle, scratch=scratch)
    return out
