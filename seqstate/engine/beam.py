"""Beam search: every batch item keeps its ``width`` best beams, each beam a batch slot.

Each step expands every live beam under its constraint, keeps the best ``width`` children of
each batch item by cumulative log-prob (earlier calls' weights included); a parent's first
surviving child takes over its slot, the others fork it, and parents with no child leave.
Finished beams write their KV back to the store, where beams' shared prefixes are stored once.
A beam search is a scheduler job like any call: its rows share decode steps with others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence

import torch

from seqstate.engine.decode import FIRST_CAPACITY, commit
from seqstate.engine.rows import LiveRow, RowRequest, RowResult
from seqstate.engine.job import Job
from seqstate.engine.step import allowed_mask
from seqstate.sampling.params import BeamSearch

__all__ = ["beam_run", "BeamJob"]


@dataclasses.dataclass(slots=True)
class _Beam:
    row: LiveRow
    weight: float          # log-prob of every generated token of the program so far
    length: int            # generated tokens of the program so far
    group: int
    slot: int = -1         # batch slot holding this beam's KV


def beam_run(model, groups: Sequence[Sequence[tuple[RowRequest, float, int]]],
             params: BeamSearch, on_step: Callable[[], None] | None = None
             ) -> Generator[None, None, list[list[tuple[RowResult, float, int]]]]:
    """Beam-search each group (one batch item's incoming beams: request, weight, length).

    Returns, per group, up to ``width`` ``(result, score, origin)`` triples sorted best-first;
    ``origin`` is the index of the incoming beam (within its group) the result descends from.
    ``on_step`` runs on the scheduler's worker after every step (a progress bar).
    """
    return (yield from model.scheduler.execute(BeamJob(model, groups, params, on_step)))


class BeamJob(Job):
    """A beam search's beams inside the scheduler."""

    def __init__(self, model, groups: Sequence[Sequence[tuple[RowRequest, float, int]]],
                 params: BeamSearch, on_step: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.model, self.groups, self.params, self.on_step = model, groups, params, on_step
        self.flat = [(g, req, w, n) for g, beams in enumerate(groups) for req, w, n in beams]
        self.finished: list[list[tuple[RowResult, float, int]]] = [[] for _ in groups]
        self.open_groups = set(range(len(groups)))
        self.beams = []
        for i, (g, req, w, n) in enumerate(self.flat):
            row = LiveRow(req, model.vocab, model.eos_token_ids)
            row.origin = i - sum(len(groups[j]) for j in range(g))
            self.beams.append(_Beam(row, w, n, g))

    def needs(self) -> tuple[list[Sequence[int]], int]:
        # the incoming rows at first; the live beams as they are when resuming after a pause
        room = max(b.row.req.max_new - len(b.row.generated) for b in self.beams)
        return [b.row.tokens for b in self.beams], min(room, FIRST_CAPACITY) + 1

    def joined(self, slots: list[int]) -> None:
        self.slots = list(slots)
        for beam, slot in zip(self.beams, self.slots):
            beam.slot = slot

    def wants(self) -> tuple[list[int], list[list[int]]]:
        return [b.slot for b in self.beams], [[b.row.tokens[-1]] for b in self.beams]

    def step(self, batch, logits: list[torch.Tensor]) -> bool:
        logits = torch.cat(logits)                                                        # (N, V)
        width, params, beams, finished = self.params.width, self.params, self.beams, self.finished
        open_groups = self.open_groups
        # 1. constrain and score: candidates are (weight + log-prob) of allowed tokens
        logprobs = logits.log_softmax(dim=-1)                                             # (N, V)
        scores = logprobs.clone()
        for i, b in enumerate(beams):
            allowed = allowed_mask(b.row, logits.shape[-1])
            if allowed is not None:
                scores[i].masked_fill_(~allowed, float("-inf"))
        # 2. per batch item, keep the best `width` children; finished ones are set aside
        survivors: list[_Beam] = []
        for g in sorted(open_groups):
            mine = [i for i, b in enumerate(beams) if b.group == g]
            k = min(2 * width, scores.shape[-1])
            top = scores[mine].topk(k, dim=-1)                                             # (n, k)
            cands = sorted(((beams[mine[r]].weight + v, mine[r], t)
                            for r in range(len(mine)) for v, t in
                            zip(top.values[r].tolist(), top.indices[r].tolist()) if v > float("-inf")),
                           reverse=True)
            kept: list[_Beam] = []
            seen: set[tuple[int, ...]] = set()
            for total, i, token in cands:
                if len(kept) >= width:
                    break
                parent = beams[i]
                child = parent.row.fork()
                child.accept(token, logprobs[i, token].item())
                key = tuple(child.tokens) + ((-1,) if child.done else ())
                if key in seen:
                    continue
                seen.add(key)
                grown = parent.length + (len(child.tokens) > len(parent.row.tokens))
                beam = _Beam(child, total, grown, g, beams[i].slot)
                if child.done:
                    finished[g].append((commit(batch, beams[i].slot, child),
                                        params.score(total, grown), child.origin))
                else:
                    kept.append(beam)
            if not kept and not finished[g]:            # nothing allowed anywhere: dead ends
                for i in mine:
                    beams[i].row.finish("dead_end")
                    finished[g].append((commit(batch, beams[i].slot, beams[i].row),
                                        params.score(beams[i].weight, beams[i].length),
                                        beams[i].row.origin))
            finished[g].sort(key=lambda rs: rs[1], reverse=True)
            del finished[g][width:]
            best_live = max((params.score(b.weight, b.length) for b in kept), default=float("-inf"))
            full = len(finished[g]) >= width
            if not kept or (full and (params.early_stopping or best_live <= finished[g][-1][1])):
                open_groups.discard(g)
            else:
                survivors.extend(kept)
        self._move_slots(batch, survivors)
        if self.on_step is not None:
            self.on_step()
        if not self.beams:
            self.finish(finished)
            return True
        return False

    # as DecodeJob: once the caller has its result (or error), no handle is held here
    def finish(self, result) -> None:
        super().finish(result)
        self.finished = []

    def fail(self, batch, exc: BaseException) -> None:
        self.finished = []
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
        for b in self.beams:
            if b.slot not in taken:
                batch.release(b.slot)
                taken.add(b.slot)             # a parent with several beams leaves once
        self.beams = survivors
        self.slots = [b.slot for b in survivors]
