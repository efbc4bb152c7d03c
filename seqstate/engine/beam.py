"""Beam search: every batch item keeps its ``width`` best beams.

Each step expands every live beam under its constraint, keeps the best ``width`` children of
each batch item by cumulative log-prob (earlier calls' weights included) and sets finished
ones aside (`Beams.advance`).  Beams are texts, not token paths: two children that spell the
same text (``"Paris"`` as one token or as ``"Par" + "is"``) are one hypothesis, the better
scored, and so are two whose constraint already determines the same final text (``"P"`` and
``"Par"`` in a choice of ``"Paris"`` and ``"Lyon"``), so a batch item's ``width`` results
are ``width`` different texts where there are so many (a constraint reads bytes, so equal
texts have equal constraint states too).

Where the candidates come from is the engine's business.  On an engine that steps rows
(`BeamJob`) every beam is a batch slot whose logits give them; a parent's first surviving
child takes over its slot, the others fork it, and parents with no child leave.  Finished
beams write their KV back to the store, where beams' shared prefixes are stored once.  A beam
search is a scheduler job like any call: its rows share decode steps with others.  On a
server (`seqstate.engine.requests.RequestRunner.beam`) every beam's step is a one-token
request for the log-probs of its most likely allowed tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from seqstate.backends.base import Fed
from seqstate.engine.buffers import StepBuffers
from seqstate.engine.decode import FIRST_CAPACITY, commit
from seqstate.engine.rows import LiveRow, RowRequest, RowResult
from seqstate.engine.job import Job, last_logits
from seqstate.engine.masks import allowed_mask
from seqstate.finish import FinishReason
from seqstate.sampling.params import BeamSearch

__all__ = ["BeamJob", "Beams", "Candidates"]

Candidates = list[tuple[int, float]]
"""A beam's most likely allowed next tokens with their log-probs, best first."""


@dataclasses.dataclass(slots=True)
class _Beam:
    row: LiveRow
    weight: float          # log-prob of every generated token of the program so far
    length: int            # generated tokens of the program so far
    group: int
    slot: int = -1         # batch slot holding this beam's KV (engines that step rows)


class Beams:
    """A search's live beams and the results found so far, advanced a token at a time from
    each live beam's `Candidates`, whoever computes them."""

    def __init__(self, model, groups: Sequence[Sequence[tuple[RowRequest, float, int]]],
                 params: BeamSearch) -> None:
        self.params = params
        self.finished: list[list[tuple[RowResult, float, int]]] = [[] for _ in groups]
        self.open_groups = set(range(len(groups)))
        self.live: list[_Beam] = []
        for g, beams in enumerate(groups):
            for origin, (req, weight, length) in enumerate(beams):
                row = LiveRow(req, model.vocab, model.eos_token_ids)
                row.origin = origin
                self.live.append(_Beam(row, weight, length, g))

    @property
    def k(self) -> int:
        """Candidates each live beam offers: ``2 * width`` would hold a batch item's ``width``
        best children even where ``width`` of them finish; more, because children that spell
        one text are one (``"a"``, ``"app"`` and ``"apples"`` in a choice of ``"apples"`` and
        ``"pears"`` leave room for ``"pears"`` only further down)."""
        return 4 * self.params.width + 16

    def advance(self, candidates: Sequence[Candidates],
                commit: Callable[[_Beam, LiveRow], RowResult]) -> list[_Beam]:
        """One step from each live beam's candidates; returns the surviving children, best
        first per batch item, each still naming its parent's slot.  ``commit(parent, row)``
        freezes a finished row's result (``row`` descends from ``parent``, or is it).  The
        caller makes the survivors `live` once their slots are settled."""
        width, params, beams, finished = self.params.width, self.params, self.live, self.finished
        survivors: list[_Beam] = []
        for g in sorted(self.open_groups):
            mine = [i for i, b in enumerate(beams) if b.group == g]
            cands = sorted(((beams[i].weight + logprob, i, token, logprob)
                            for i in mine for token, logprob in candidates[i]), reverse=True)
            kept: list[_Beam] = []
            seen: set[tuple[int, ...]] = set()
            for total, i, token, logprob in cands:
                if len(kept) >= width:
                    break
                parent = beams[i]
                child = parent.row.fork()
                child.accept(token, logprob)
                key = _hypothesis(child)
                if key in seen:
                    continue
                seen.add(key)
                grown = parent.length + (len(child.tokens) > len(parent.row.tokens))
                if child.done:
                    score = params.score(total, grown)
                    same = [k for k, (r, _, o) in enumerate(finished[g])
                            if r.text == child.text and o == child.origin]
                    if same and finished[g][same[0]][1] >= score:
                        continue                 # the same text found before, better scored
                    if same:
                        del finished[g][same[0]]
                    finished[g].append((commit(parent, child), score, child.origin))
                else:
                    kept.append(_Beam(child, total, grown, g, parent.slot))
            if not kept and not finished[g]:            # nothing allowed anywhere: dead ends
                for i in mine:
                    beams[i].row.finish(FinishReason.DEAD_END)
                    finished[g].append((commit(beams[i], beams[i].row),
                                        params.score(beams[i].weight, beams[i].length),
                                        beams[i].row.origin))
            finished[g].sort(key=lambda rs: rs[1], reverse=True)
            del finished[g][width:]
            best_live = max((params.score(b.weight, b.length) for b in kept), default=float("-inf"))
            full = len(finished[g]) >= width
            if not kept or (full and (params.early_stopping or best_live <= finished[g][-1][1])):
                self.open_groups.discard(g)
            else:
                survivors.extend(kept)
        return survivors


def _hypothesis(row: LiveRow) -> tuple:
    """What a beam stands for: its final text where that is known (a finished beam's, or
    one its constraint forces to the end: the rest of a choice's option), else its text so
    far with the bytes of a character not complete yet."""
    if row.done:
        return row.origin, row.text
    forced = row.cursor.draft() if row.cursor is not None else ()
    end = row.cursor
    for token in forced:
        end = end.advance(token)
        if end is None:
            break
    if forced and end is not None and end.complete:
        decoder = row.decoder.copy()
        rest = "".join(decoder.push(t) for t in forced) + decoder.flush()
        return row.origin, row.text + rest
    return row.origin, row.text, row.decoder.pending


def candidates(logits: torch.Tensor, beams: Sequence[_Beam], k: int) -> list[Candidates]:
    """Each beam's ``k`` most likely allowed tokens from its next-token logits ``(N, V)``."""
    logprobs = logits.log_softmax(dim=-1)                                                 # (N, V)
    for i, b in enumerate(beams):
        allowed = allowed_mask(b.row, logits.shape[-1])
        if allowed is not None:
            logprobs[i].masked_fill_(~allowed, float("-inf"))
    top = logprobs.topk(min(k, logits.shape[-1]), dim=-1)                                # (N, k)
    return [[(t, v) for v, t in zip(values, tokens) if v > float("-inf")]
            for values, tokens in zip(top.values.tolist(), top.indices.tolist())]


class BeamJob(Job):
    """A beam search's beams inside the scheduler, one batch slot each."""

    def __init__(self, model, groups: Sequence[Sequence[tuple[RowRequest, float, int]]],
                 params: BeamSearch, on_step: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.model, self.on_step = model, on_step
        self.beams = Beams(model, groups, params)

    def needs(self) -> tuple[list[Sequence[int]], int]:
        # the incoming rows at first; the live beams as they are when resuming after a pause
        live = self.beams.live
        room = max(b.row.req.max_new - len(b.row.generated) for b in live)
        return [b.row.tokens for b in live], min(room, FIRST_CAPACITY) + 1

    def joined(self, slots: list[int]) -> None:
        self.slots = list(slots)
        for beam, slot in zip(self.beams.live, self.slots):
            beam.slot = slot

    def wants(self) -> tuple[list[int], list[list[int]]]:
        return [b.slot for b in self.beams.live], [[b.row.tokens[-1]] for b in self.beams.live]

    def step(self, batch, logits: torch.Tensor | Fed, buffers: StepBuffers) -> bool:
        beams = self.beams
        found = candidates(last_logits(logits), beams.live, beams.k)
        survivors = beams.advance(found, lambda parent, row: commit(batch, parent.slot, row))
        self._move_slots(batch, survivors)
        if self.on_step is not None:
            self.on_step()
        if not beams.live:
            self.finish(beams.finished)
            return True
        return False

    # as DecodeJob: once the caller has its result (or error), no handle is held here
    def finish(self, result) -> None:
        super().finish(result)
        self.beams.finished = []

    def fail(self, batch, exc: BaseException) -> None:
        self.beams.finished = []
        super().fail(batch, exc)

    def _move_slots(self, batch, survivors: list[_Beam]) -> None:
        """A parent's first surviving child takes its slot; later children fork it."""
        taken: set[int] = set()
        forks: list[int] = []
        try:
            for b in survivors:
                if b.slot in taken:
                    b.slot = batch.fork(b.slot)
                    forks.append(b.slot)
                else:
                    taken.add(b.slot)
        except BaseException:
            for slot in forks:                    # the parents' slots are still self.slots
                batch.release(slot)
            raise
        for b in self.beams.live:
            if b.slot not in taken:
                batch.release(b.slot)
                taken.add(b.slot)             # a parent with several beams leaves once
        self.beams.live = survivors
        self.slots = [b.slot for b in survivors]
