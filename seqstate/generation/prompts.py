"""A call's rows: prompts become rows, states fork into samples, rows become requests."""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any

from seqstate.call import DEFAULT_MAX_TOKENS, MAX_CONSTRAINED_TOKENS, Call
from seqstate.engine.rows import RowRequest
from seqstate.errors import ArgumentError, ContextOverflowError, ModelMismatch, SampleMismatch
from seqstate.models.base import BaseModel
from seqstate.rows import Row
from seqstate.state import SequenceState

__all__ = ["Prompt", "prompt_row", "as_state", "fork", "requests"]

Prompt = str | Sequence[str] | SequenceState


def prompt_row(model: BaseModel, text: str) -> Row:
    """A prompt's row; the empty prompt is the model's start token."""
    ids = tuple(model.encode_prompt(text))
    return Row.plain(ids)


def as_state(model: BaseModel, prompt: Prompt) -> SequenceState:
    """``prompt`` (a str, a list of str, one per batch item, or a state) as a state of
    ``model`` whose rows all have tokens."""
    if isinstance(prompt, SequenceState):
        if prompt.model is not model:
            raise ModelMismatch.between(prompt.model, model, "the generator uses",
                                        "build the generator on the state's model "
                                        "(state.model), or load the model once and share it")
        if all(r.tokens for r in prompt.rows):
            return prompt
        # an empty row is continued like the empty prompt: from the start token
        return prompt._with_rows([r if r.tokens else prompt_row(model, "") for r in prompt.rows])
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
        raise ArgumentError(f"a prompt is a str, a non-empty list of str (one per batch item) or "
                            f"a SequenceState, got {type(prompt).__name__} "
                            f"{reprlib.repr(prompt)}; encode other values as text first, or "
                            "build a state from token ids with ss.from_tokens")
    rows = [prompt_row(model, t) for t in texts]
    return SequenceState(model, tuple(rows), len(rows), 1)


def fork(state: SequenceState, k: int | None) -> SequenceState:
    """Each batch item's row as ``k`` samples (None: the state's samples as they are)."""
    if k is None or k == state.n_samples:
        return state
    if state.n_samples != 1:
        raise SampleMismatch(f"num_samples={k} asked of a state with {state.n_samples} samples; "
                             f"pass num_samples=None (or {state.n_samples}) to continue each "
                             "sample, or slice one sample first (state[:, 0, :])")
    rows = [r for r in state.rows for _ in range(k)]
    return SequenceState(state.model, tuple(rows), state.n_batch, k)


def requests(state: SequenceState, call: Call, cursors: Sequence[Any], constrained: bool,
             healed: Sequence[str] | None = None,
             replays: Sequence[Sequence[int]] | None = None) -> list[RowRequest]:
    """One engine request per row; a row that cannot fit the context is refused here.
    ``replays[i]``: the tokens row ``i`` already generated under its cursor (resuming)."""
    ctx = state.model.context_length
    reqs = []
    default = MAX_CONSTRAINED_TOKENS if constrained else DEFAULT_MAX_TOKENS
    for r, cursor, removed, replay in zip(state.rows, cursors, healed or [""] * len(cursors),
                                          replays or [()] * len(cursors)):
        room = ctx - len(r.tokens)
        want = call.max_tokens if call.max_tokens is not None else min(default, room)
        if want > room or room <= 0:
            raise ContextOverflowError(
                f"a row of {len(r.tokens)} tokens plus max_tokens={call.max_tokens} exceeds the "
                f"model's context of {ctx} tokens; shorten the prompt or lower max_tokens")
        reqs.append(RowRequest(r.tokens, want, cursor, call.stops, len(removed), tuple(replay)))
    return reqs
