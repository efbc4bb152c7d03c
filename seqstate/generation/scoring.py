"""``choice(..., method="score")``: rank whole options by their log-prob given the state."""

from __future__ import annotations

from typing import Any

from seqstate.call import Call
from seqstate.constraints import compile as compiled
from seqstate.engine.scoring import score
from seqstate.generation import capabilities, prompts
from seqstate.generation.generator import Generator
from seqstate.generation.prompts import Prompt
from seqstate.models.base import BaseModel as Model
from seqstate.rows import Row, Span
from seqstate.state import SequenceState

__all__ = ["ScoredChoice"]


class ScoredChoice(Generator):
    """``choice(..., method="score")``: rank whole options by their log-prob given the state."""

    def __init__(self, model: Model, options: Any, length_normalize: bool) -> None:
        super().__init__(model, None, "choice(score)")
        self.texts, self.values = compiled.options_of(options)
        self.option_ids = [model.encode(t) for t in self.texts]
        self.length_normalize = length_normalize

    def _stream(self, prompt: Prompt, call: Call, resume: bool, chunks: bool = True):
        if resume:
            raise ValueError("a scored choice has nothing to resume; call it again instead")
        start = prompts.as_state(self.model, prompt)
        state = prompts.fork(start, call.num_samples)
        if state is not start:
            capabilities.check_fork(self.model, state.n_samples)
        prompts.requests(state, Call(max_tokens=max(map(len, self.option_ids))),
                         [None] * len(state.rows), constrained=False)
        scored = score(self.model, [r.tokens for r in state.rows], self.option_ids)
        rows = []
        for row, per_option in zip(state.rows, scored):
            scores = {t: (sum(lps) / len(lps) if self.length_normalize else sum(lps))
                      for t, (lps, _) in zip(self.texts, per_option)}
            best = max(range(len(self.texts)), key=lambda j: scores[self.texts[j]])
            lps, handle = per_option[best]
            span = Span(len(row.tokens), len(row.tokens) + len(lps), self, "scored",
                        self.values[best], scores, call.name)
            rows.append(Row(row.tokens + tuple(self.option_ids[best]), handle,
                            row.logprobs + tuple(lps), row.cursors + (None,) * len(lps),
                            row.spans + (span,), row.chat))
        return SequenceState(self.model, tuple(rows), state.n_batch, state.n_samples)
        yield  # a generator function, like Generator._stream: scoring streams nothing
