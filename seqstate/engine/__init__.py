"""The batched decoding engine: prefill of uncached tails, then an in-place decode loop."""

from seqstate.engine.decode import generate, next_logits, run
from seqstate.engine.prefill import ensure_kv
from seqstate.engine.rows import RowRequest, RowResult
from seqstate.engine.step import StepEvent, Stepper

__all__ = ["generate", "run", "next_logits", "ensure_kv", "RowRequest", "RowResult", "Stepper",
           "StepEvent"]
