"""Engine capabilities a call needs, checked before any compute.

Which feature needs which `Capabilities` field (the mapping the field docs state):

=================  ==============================================================
full_logits        ``model.full_logits()`` and samplers a server has not
                   (`RequestBackend.check_sampler`); an engine that steps rows has
                   them by definition (hooks' `SampleEvent` carries the whole
                   next-token distribution there, beams are expanded over it); a
                   server runs hooks on its stream (``event.logits`` None), sends
                   each beam's most likely allowed tokens and a whole distribution
                   per ``state.next_logprobs()`` request instead
prefix_sharing     forking: ``num_samples=k > 1`` on a one-sample state (the samples
                   share their prompt's KV); beam search (beams fork as they split)
batching           a decoding call over more than one row (several prompts or
                   samples); beam search over more than one beam
=================  ==============================================================

Free text, constraints, samplers and their penalties, stop strings, token healing and
scoring (``state.score``, ``choice(..., method="score")``) need none of them: an engine
runs them where its logits live.
"""

from __future__ import annotations

from seqstate.errors import ContextOverflowError
from seqstate.models.base import BaseModel
from seqstate.sampling.params import BeamSearch

__all__ = ["require", "check_call", "check_beam", "check_fork", "check_rows"]

def require(model: BaseModel, capability: str, feature: str, instead: str) -> None:
    """Raise `CapabilityError` when ``model``'s engine lacks ``capability``, which
    ``feature`` needs; ``instead`` says what to do."""
    model.backend.capabilities.require(capability, feature, instead, model.name)


def check_fork(model: BaseModel, samples: int) -> None:
    """Forking each batch item into ``samples`` samples."""
    require(model, "prefix_sharing", f"num_samples={samples} (forking a state into samples)",
            "fork on an engine that shares prefixes (hf, llama.cpp), or make one call per "
            "sample")


def check_call(model: BaseModel, rows: int) -> None:
    """A decoding call over ``rows`` rows (with or without hooks: every engine runs them,
    one that steps rows on its logits, a server on its stream)."""
    if rows > 1:
        require(model, "batching", f"a call over {rows} rows",
                "make one call per prompt and sample, or use an engine that batches "
                "(hf, llama.cpp)")


def check_beam(model: BaseModel, params: BeamSearch) -> None:
    """Beam search of ``params.width`` beams per batch item (its rows are checked as any
    call's are)."""
    instead = "use ss.greedy() or ss.multinomial(...), or an engine with it (hf, llama.cpp)"
    require(model, "prefix_sharing", "beam search", instead)
    if params.width > 1:
        require(model, "batching", f"beam search of width {params.width}", instead)


def check_rows(model: BaseModel, rows: int, feature: str) -> None:
    """``feature`` runs ``rows`` rows at once: refused when the engine holds fewer
    (`Capabilities.max_rows`; llama.cpp: ``n_seq_max`` - 3)."""
    caps = model.backend.capabilities
    if caps.max_rows is not None and rows > caps.max_rows:
        raise ContextOverflowError(
            f"{feature} runs {rows} rows at once, but the {caps.name!r} engine of "
            f"{model.name!r} holds at most {caps.max_rows} (its max_rows; on llama.cpp, "
            f"n_seq_max - 3): narrow the beam, split the batch, or load the model with a "
            f"larger n_seq_max")
