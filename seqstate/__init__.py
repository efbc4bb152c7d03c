"""seqstate: structured LLM generation on immutable, forkable sequence states."""

from seqstate import models
from seqstate.errors import (BatchMismatch, ConstraintError, ContextOverflowError, HookError,
                             ModelMismatch, ModelNotAvailable, SampleMismatch, SeqStateError,
                             SlicingError)

__all__ = ["models", "SeqStateError", "SlicingError", "BatchMismatch", "SampleMismatch",
           "ModelMismatch", "ConstraintError", "ContextOverflowError", "ModelNotAvailable",
           "HookError"]
