"""The batched decoding engine: prefill of uncached tails, then an in-place decode loop."""

from seqstate.engine.decode import generate, run
from seqstate.engine.logprob_jobs import next_logprobs, score
from seqstate.engine.rows import Decoding, RowRequest, RowResult
from seqstate.engine.step import StepEvent, Stepper

__all__ = ["generate", "run", "next_logprobs", "score", "Decoding", "RowRequest", "RowResult",
           "Stepper", "StepEvent"]
