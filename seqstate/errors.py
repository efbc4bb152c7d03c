"""The seqstate error hierarchy.

Every error subclasses `SeqStateError` and the matching built-in, so callers can catch
either.  Messages say what was expected, what was got, and what to do instead.
"""

from __future__ import annotations

__all__ = [
    "SeqStateError",
    "SlicingError",
    "BatchMismatch",
    "SampleMismatch",
    "ModelMismatch",
    "ConstraintError",
    "ContextOverflowError",
    "CacheFullError",
    "ModelNotAvailable",
    "ChatTemplateError",
    "HookError",
    "ActivationHookError",
    "ArgumentError",
    "CapabilityError",
    "EngineError",
    "AuthenticationError",
    "CaptureNotFound",
    "LogitsError",
    "CallTimeout",
    "HookNameError",
    "PrefixPositionError",
    "Interrupted",
    "ModelClosed",
    "CheckpointError",
    "StateFormatError",
]


class SeqStateError(Exception):
    """Base class of every error seqstate raises on purpose."""


class SlicingError(SeqStateError, IndexError):
    """A key that cannot be applied to a state, or a strict slice that cannot keep its KV."""


class ChatTemplateError(SeqStateError, ValueError):
    """A chat turn that cannot be rendered: no chat template, a state that is not a
    conversation, or a template that rewrites earlier turns when a new one follows."""


class BatchMismatch(SeqStateError, ValueError):
    """Two operands of ``+`` whose (batch, samples) shapes cannot be broadcast together."""


class SampleMismatch(SeqStateError, ValueError):
    """``num_samples=k`` asked of a state that already has ``S`` samples, ``S not in (1, k)``."""


class ModelMismatch(SeqStateError, ValueError):
    """A state made with one model or tokenizer given to a generator of another."""

    @classmethod
    def between(cls, made_with: object, given: object, doing: str, fix: str) -> ModelMismatch:
        """The error for a state of ``made_with`` used ``doing`` with ``given``, telling the
        two models apart when they print alike (two loads of the same weights)."""
        first, second = repr(made_with), repr(given)
        if first == second:
            first += f" (object at {id(made_with):#x})"
            second = (f"another object of the same name at {id(given):#x}: a state belongs "
                      f"to the model object that made it, and two loads of one model do not "
                      f"share states")
        return cls(f"this state was made with {first} but {doing} {second}; {fix}")


class ConstraintError(SeqStateError, ValueError):
    """An invalid regex, schema, grammar or choice list, reported before any model call; on
    the ``vllm`` engine also one the server refuses, cannot build within its bounds, or fails
    on mid-call (its plugin says which)."""


class ContextOverflowError(SeqStateError, ValueError):
    """A request that cannot fit the model's context window, raised before any compute."""


class CacheFullError(ContextOverflowError):
    """The engine's shared KV cache has no room *now*: what is left is held by working rows
    (and the stored paths they borrow), though the request would fit without them.  Raised
    inside the engine after evicting every stored path no work in progress uses (kept states'
    too); the scheduler then pauses newer calls instead of failing this one, so a caller sees
    it only when its call met a full cache with no newer call to pause and nothing to wait
    for.  A plain `ContextOverflowError` means the call cannot fit even alone."""


class ModelNotAvailable(SeqStateError, RuntimeError):
    """A model's weights cannot be found locally (seqstate never downloads)."""


class HookError(SeqStateError, RuntimeError):
    """A post-sampling hook returned an action that cannot be honoured."""


class ActivationHookError(SeqStateError, RuntimeError):
    """Compute refused, before it starts, on a model whose torch forward hooks or pre-hooks
    could edit activations: the KV it computed would be stored under plain tokens and
    reused by later clean calls.  Run such calls inside ``with model.frozen_store():``
    (stored KV is read, nothing is written), or remove the hooks.  ``hooks`` maps each
    hooked module's name (``"<global>"`` for torch's global hooks) to its hook count."""

    def __init__(self, message: str, hooks: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.hooks = dict(hooks or {})

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.hooks))


class ArgumentError(SeqStateError, TypeError, ValueError):
    """An argument of the wrong type or value: a prompt, a generator call's or a sampler's
    keyword, what ``ss.from_tokens``, ``ss.continuous``, ``ss.chat`` and ``ss.run_batch`` are
    given, or a combination a call does not take (hooks with beam search, ``token_healing``
    on ``resume()``).

    It is both a ``TypeError`` and a ``ValueError``, so code written for either catches it.
    """


class CapabilityError(SeqStateError, NotImplementedError):
    """A feature that needs an engine capability the model's engine does not have, refused
    before any compute.  ``capability`` names the missing `Capabilities` field (such as
    ``"full_logits"``), ``engine`` the engine (``model.engine``)."""

    def __init__(self, message: str, capability: str = "", engine: str = "") -> None:
        super().__init__(message)
        self.capability, self.engine = capability, engine

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.capability, self.engine))


class EngineError(SeqStateError, ConnectionError):
    """An engine that did not answer: a server unreachable, dead mid-call or refusing a
    request for a reason of its own.  Raised to the caller of the call that met it; every
    existing state stays as it was, and the model is usable again once its engine is."""


class AuthenticationError(EngineError, PermissionError):
    """A server that refused the API key sent (a wrong one) or refused the request for want
    of one (HTTP 401 or 403), raised before any generation: by ``ss.models.vllm(...)``,
    whose first request lists the served models.  The message names the server and what to
    pass (``api_key=``, ``$SEQSTATE_VLLM_API_KEY``)."""


class CaptureNotFound(SeqStateError, KeyError):
    """``state[name]`` or ``state.captures[name]`` for a name no call of the state's rows
    recorded (never named, or its tokens were sliced off).  A ``KeyError``, so ``name in
    state.captures`` and ``state.captures.get(name)`` behave as for any mapping."""

    def __str__(self) -> str:
        # KeyError's own str() is the repr of its argument: quotes around a whole sentence
        return str(self.args[0]) if self.args else ""


class LogitsError(SeqStateError, ValueError):
    """Logits the decoding step cannot use: the wrong shape from a custom step driving
    ``ss.engine.Stepper``, or a row whose every logit is NaN or infinite (usually fp16/bf16
    overflow in the model's forward)."""


class CallTimeout(SeqStateError, TimeoutError):
    """A generator call that ran past its own ``timeout=``.  Its rows leave the running
    batch at the next step and what they held is released, as for a cancelled call; every
    existing state stays as it was and the other calls go on."""


class HookNameError(SeqStateError, KeyError):
    """An activation name that names no hook point of the model (``state.run_with_cache``,
    ``state.with_hooks``), or a name an `ActivationCache` does not hold.  The message
    lists the forms the model accepts.  A ``KeyError``, as for any mapping lookup."""

    def __str__(self) -> str:
        # KeyError's own str() is the repr of its argument: quotes around a whole sentence
        return str(self.args[0]) if self.args else ""


class PrefixPositionError(SeqStateError, IndexError):
    """A hook asked for a position of the stored prefix: those positions' KV was read from
    the store, not computed, so no hook sees or changes them.  The message says how to
    compute them instead (``start=`` on the call: from that position on, ``start=0`` a whole
    forward)."""


class Interrupted(SeqStateError, RuntimeError):
    """A generator call ended because the program run it belongs to was interrupted: Ctrl-C
    during ``ss.run_batch``, or its ``ss.arun_batch`` cancelled or timed out.  Its rows leave
    the running batch at the next step; every existing state stays as it was."""


class CheckpointError(SeqStateError, ValueError):
    """A ``run_batch`` checkpoint that cannot be used: made by another program, model or
    input list, or a result that cannot be stored (reported at the first one)."""


class StateFormatError(SeqStateError, ValueError):
    """Bytes that ``ss.loads`` cannot read as a state: not a saved state, a newer format
    version, or damaged."""


class ModelClosed(ModelNotAvailable):
    """A call on a model after ``model.close()``: its engine has let go of what it held.
    Load the model again to keep working."""
