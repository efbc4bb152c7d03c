"""seqstate: structured LLM generation on immutable, forkable sequence states."""

from seqstate import engine, kv, models, sampling
from seqstate.errors import (BatchMismatch, ConstraintError, ContextOverflowError, HookError,
                             ModelMismatch, ModelNotAvailable, SampleMismatch, SeqStateError,
                             SlicingError)

__all__ = ["models", "engine", "kv", "sampling", "SeqStateError", "SlicingError", "BatchMismatch", "SampleMismatch",
           "ModelMismatch", "ConstraintError", "ContextOverflowError", "ModelNotAvailable",
           "HookError"]
