"""``choice(..., method="score")``: rank whole options by their log-prob given the state."""

from __future__ import annotations

from typing import Any

from seqstate.call import Call
from seqstate.constraints import compile as compiled
from seqstate.engine.waiting import Caller
from seqstate.errors import ArgumentError
from seqstate.finish import FinishReason
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

    def _stream(self, prompt: Prompt, call: Call, resume: bool, chunks: bool = True,
                caller: Caller | None = None):
        # scoring runs to its end in one go: from an event loop (acall), it holds the loop
        # for the scoring forward
        if resume:
            raise ArgumentError("resume() continues a constraint part-way through its tokens, but "
                                "choice(method='score') adds a whole option in one step, so there "
                                "is nothing to resume; call the generator on the state instead")
        start = prompts.as_state(self.model, prompt)
        state = prompts.fork(start, call.num_samples)
        if state is not start:
            capabilities.check_fork(self.model, state.n_samples)
        prompts.requests(state, Call(max_tokens=max(map(len, self.option_ids))),
                         [None] * len(state.rows), constrained=False)
        call.warn_unused()
        # every option scored without storing its KV; then only the winners are stored
        scored = self.model.runner.score([(r.tokens, o) for r in state.rows
                                          for o in self.option_ids])
        n = len(self.option_ids)
        best, totals = [], []
        for i in range(len(state.rows)):
            per = scored[i * n: (i + 1) * n]
            total = {t: (sum(s.logprobs) / len(s.logprobs) if self.length_normalize
                         else sum(s.logprobs)) for t, s in zip(self.texts, per)}
            best.append(max(range(n), key=lambda j: total[self.texts[j]]))
            totals.append((total, per))
        kept = self.model.runner.stored([r.tokens + tuple(self.option_ids[j])
                                         for r, j in zip(state.rows, best)])
        rows = []
        for row, j, (total, per), handle in zip(state.rows, best, totals, kept):
            lps = per[j].logprobs
            span = Span(len(row.tokens), len(row.tokens) + len(lps), self, FinishReason.SCORED,
                        self.values[j], total, call.name)
            rows.append(Row(row.tokens + tuple(self.option_ids[j]), handle,
                            row.logprobs + lps, row.cursors + (None,) * len(lps),
                            row.spans + (span,), row.chat))
        return SequenceState(self.model, tuple(rows), state.n_batch, state.n_samples)
        yield  # a generator function, like Generator._stream: scoring streams nothing
