"""A generator call under ``ss.beam_search``: each batch item's samples are its incoming beams."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import Any

from seqstate.call import Call
from seqstate.engine.waiting import Caller
from seqstate.errors import ArgumentError, SampleMismatch
from seqstate.generation import capabilities
from seqstate.generation.prompts import Prompt
from seqstate.progress import progress_bar
from seqstate.state import SequenceState

__all__ = ["beam"]


def beam(gen, prompt: Prompt, call: Call, resume: bool, caller: Caller | None = None
         ) -> Generator[Any, None, SequenceState]:
    """Beam search over each batch item's samples; returns up to ``width`` samples each.

    ``gen`` is the `Generator` making the call: its rows are prepared and recorded as any
    call's are.  A generator that yields nothing but `PAUSE` to an awaiting ``caller``.
    """
    params = call.sampler
    if call.num_samples not in (None, params.width):
        raise SampleMismatch(f"beam search returns width={params.width} samples per batch item; "
                             f"got num_samples={call.num_samples} (leave it out)")
    if call.hooks:
        raise ArgumentError(f"hooks run with greedy or multinomial sampling, not beam search; "
                            f"got {len(call.hooks)} hook(s) with ss.beam_search({params.width}): "
                            "drop hooks=..., or sample with ss.greedy() / ss.multinomial()")
    capabilities.check_beam(gen.model, params)
    state, requests, span_starts, healed = gen._prepare(
        prompt, dataclasses.replace(call, num_samples=None), resume)
    groups = []
    for b in range(state.n_batch):
        beams, seen = [], set()
        for s in range(state.n_samples):
            i = b * state.n_samples + s
            row = state.rows[i]
            if row.tokens in seen:
                continue
            seen.add(row.tokens)
            weight = sum(lp for lp in row.logprobs if lp is not None)
            length = sum(lp is not None for lp in row.logprobs)
            beams.append((requests[i], weight, length, i))
        groups.append(beams)
    capabilities.check_rows(gen.model, len(groups) * params.width,
                            f"beam search of width {params.width} over {len(groups)} batch "
                            f"item(s)")
    width = max(r.max_new for r in requests)
    with progress_bar(call.progress, width, gen.name, "tok") as bar:
        results = yield from gen.model.runner.beam(
            [[g[:3] for g in beams] for beams in groups], params,
            None if bar is None else lambda: bar.update(1), caller)
    samples = min(len(r) for r in results)
    rows = []
    for beams, found in zip(groups, results):
        for res, _, origin in found[:samples]:
            i = beams[origin][3]
            rows.append(gen._row(state.rows[i], res, span_starts[i], healed[i], call.name))
    return SequenceState(gen.model, tuple(rows), state.n_batch, samples)
