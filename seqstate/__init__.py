"""seqstate: structured LLM generation on immutable, forkable sequence states."""

from seqstate import (activations, backends, constraints, engine, grammars, hooks, models,
                      sampling, viz)
from seqstate.programs import BatchError, arun_batch, run_batch
from seqstate.checkpoint import checkpoint_results
from seqstate.conversation import chat
from seqstate.errors import (ActivationHookError, ArgumentError, AuthenticationError,
                             BatchMismatch, CacheFullError, CallTimeout, CapabilityError,
                             CaptureNotFound, ChatTemplateError, ConstraintError,
                             ContextOverflowError, EngineError, HookError, HookNameError,
                             LogitsError, ModelMismatch, ModelNotAvailable,
                             PrefixPositionError, SampleMismatch, SeqStateError, SlicingError,
                             Interrupted, CheckpointError, ModelClosed, StateFormatError)
from seqstate.finish import FinishReason
from seqstate.generation import (Generator, cfg, choice, continuous, final_state, json, regex,
                                 text)
from seqstate.sampling import beam_search, greedy, multinomial
from seqstate.scores import Scores
from seqstate.persist import SavedState
from seqstate.restore import from_tokens, loads
from seqstate.state import SequenceState

__all__ = [
    "SequenceState", "from_tokens", "loads", "SavedState", "Scores", "Generator", "text", "choice", "regex", "json", "cfg",
    "continuous", "final_state", "FinishReason", "chat", "run_batch", "arun_batch", "BatchError",
    "checkpoint_results",
    "greedy", "multinomial", "beam_search",
    "models", "backends", "engine", "sampling", "constraints", "grammars", "hooks", "viz",
    "SeqStateError", "SlicingError", "BatchMismatch", "SampleMismatch", "ModelMismatch",
    "ConstraintError", "ContextOverflowError", "CacheFullError", "ModelNotAvailable", "HookError",
    "ArgumentError",
    "ChatTemplateError", "CapabilityError", "ActivationHookError", "EngineError",
    "AuthenticationError", "CaptureNotFound", "LogitsError", "CallTimeout", "HookNameError",
    "PrefixPositionError", "activations", "Interrupted", "ModelClosed", "CheckpointError",
    "StateFormatError",
]
