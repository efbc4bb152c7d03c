"""What every model has, whatever its engine: a tokenizer side, a backend, counters."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from seqstate.backends.base import Backend, StepBackend, WorkCounters
from seqstate.engine.requests import RequestRunner
from seqstate.engine.runner import ClosedRunner, Runner
from seqstate.engine.scheduler import Scheduler
from seqstate.errors import ArgumentError

if TYPE_CHECKING:
    from seqstate.detokenize import TokenVocabulary

__all__ = ["BaseModel", "Stats", "require_model"]


@dataclasses.dataclass(frozen=True, slots=True)
class Stats(WorkCounters):
    """A snapshot of a model's work counters (`seqstate.backends.base.WorkCounters`) and KV
    accounting.

    Subtract two snapshots to see what one call did.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> before = model.stats
    >>> s = ss.text(model)("Hello there", max_tokens=4)
    >>> used = model.stats - before
    >>> used.decode_tokens >= 1 and used.forward_calls >= 1
    True
    """

    kv_bytes_held: int = 0           # bytes of stored KV that live states refer to
    kv_bytes_cached: int = 0         # bytes of every stored KV (held or not: all evictable)
    evictions: int = 0               # stored KV dropped under the budget (segments, paths)
    live_evictions: int = 0          # of those, KV live states referred to (then recomputed)
    segments: int = 0

    def __sub__(self, other: Stats) -> Stats:
        return Stats(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                        for f in dataclasses.fields(self)})


class BaseModel:
    """A tokenizer, the engine behind it (``backend``), the runner its calls go through
    (``runner``), a compiled-constraint cache and a lock.

    Generators and states use only what is here, so they run the same on every engine.
    Subclasses set ``backend``.
    """

    hf_model: Any = None

    def __init__(self, hf_tokenizer: Any, name: str) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.name = name
        self.lock = threading.RLock()                 # one engine step at a time per model
        self.constraint_cache: dict[Any, Any] = {}   # compiled constraints, keyed by spec

    def __repr__(self) -> str:
        return (f"<seqstate {type(self).__name__} {self.name!r} engine={self.engine} "
                f"ctx={self.context_length}>")

    @property
    def engine(self) -> str:
        """The engine's name (``backend.capabilities.name``): ``"hf"``, ``"llama.cpp"`` or
        ``"vllm"``, as in `seqstate.CapabilityError`'s ``engine``.

        Examples
        --------
        >>> import seqstate as ss
        >>> ss.models.testing.tiny().engine
        'hf'
        """
        return self.backend.capabilities.name

    @property
    def device(self) -> torch.device:
        """Where the engine's logits live (``backend.device``): the network's device on the
        ``hf`` engine, the CPU where a library or a server hands logits over.  Seeded calls
        draw on it.

        Examples
        --------
        >>> import seqstate as ss
        >>> ss.models.testing.tiny().device
        device(type='cpu')
        """
        return self.backend.device

    @property
    def context_length(self) -> int:
        """The longest row the engine runs (``backend.context_length``)."""
        return self.backend.context_length

    @property
    def store(self) -> Any:
        """The engine's radix store (``verify()`` checks its links and accounting), or None
        on an engine that keeps KV elsewhere (a server)."""
        return self.backend.store

    @property
    def backend(self) -> Backend:
        """The engine behind this model.  Setting it (a subclass does, once, when the model is
        built) picks the model's ``runner`` by the backend's kind: a
        `seqstate.engine.scheduler.Scheduler` for a `StepBackend` (concurrent calls share
        decode steps), a `seqstate.engine.requests.RequestRunner` for a server.  Both are a
        `seqstate.engine.runner.Runner`: ``run``, ``generate``, ``beam``, ``score``,
        ``next_logprobs`` and ``stored``, with the same signatures.

        Examples
        --------
        >>> import seqstate as ss
        >>> type(ss.models.testing.tiny().runner).__name__
        'Scheduler'
        """
        return self._backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self._backend = backend
        self.runner: Runner = (
            Scheduler(self) if isinstance(backend, StepBackend) else RequestRunner(self))

    def close(self) -> None:
        """Let go of what the engine holds: the running calls fail with
        `seqstate.ModelClosed`, the worker thread ends, the engine frees its memory (llama.cpp
        its context) or its connections (vLLM; the server keeps running).  Every call
        afterwards raises `seqstate.ModelClosed` before any compute; states made on the model
        keep their tokens and texts.  Closing twice does nothing.  A model is also a context
        manager that closes it at the end of the block.

        Examples
        --------
        >>> import seqstate as ss
        >>> model = ss.models.testing.tiny()
        >>> s = ss.text(model)("Hello", max_tokens=2)
        >>> model.close()
        >>> try:
        ...     ss.text(model)(s, max_tokens=2)
        ... except ss.ModelClosed:
        ...     print("closed")
        closed
        """
        with self.lock:
            runner = self.runner
            if isinstance(runner, ClosedRunner):
                return
            self.runner = ClosedRunner(self.name)
        close = getattr(runner, "close", None)
        if close is not None:
            close()
        self.backend.close()

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return isinstance(self.runner, ClosedRunner)

    def __enter__(self) -> BaseModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- tokenizer ----------------------------------------------------------------------------
    @cached_property
    def vocab(self) -> TokenVocabulary:
        from seqstate.detokenize import TokenVocabulary

        return TokenVocabulary.of(self.hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of text appended to a state: no special tokens."""
        return self.vocab.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a string prompt, as ``tokenizer(text)`` gives them (BOS included where
        the tokenizer adds one); an empty prompt is the model's start token."""
        return self.vocab.encode_prompt(text) or list(self.start_token_ids)

    def _eos_sources(self) -> list[Any]:
        return [self.hf_tokenizer]

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in self._eos_sources():
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return frozenset(ids)

    @property
    def pad_token_id(self) -> int:
        pad = self.hf_tokenizer.pad_token_id
        return pad if pad is not None else min(self.eos_token_ids, default=0)

    @cached_property
    def start_token_ids(self) -> list[int]:
        """What an empty prompt is replaced by: the BOS token (or EOS where there is none)."""
        bos = self.hf_tokenizer.bos_token_id
        for source in self._eos_sources():
            if bos is None:
                bos = getattr(source, "bos_token_id", None)
        return [bos if bos is not None else min(self.eos_token_ids)]

    # -- counters -----------------------------------------------------------------------------
    @property
    def stats(self) -> Stats:
        """A snapshot of the work counters and the KV accounting."""
        return Stats(**self.backend.counters, **self.backend.kv_stats())

    def count(self, **deltas: int) -> None:
        self.backend.count(**deltas)

    @contextlib.contextmanager
    def frozen_store(self) -> Iterator[BaseModel]:
        """A block in which stored KV is read and nothing is written to the store.

        Calls inside work as usual: they reuse stored prefixes, prefill what is missing,
        decode, and return states whose handles hold the KV they computed.  But that KV is
        *scratch*: no later call matches it (continuing such a state recomputes its tokens
        past the stored prefix) and it is freed as soon as no state holds it, so the store is
        the same before and after the block.  On the HF engine this is where torch forward
        hooks are allowed (activation patching, steering): outside a block a hooked model is
        refused with `seqstate.ActivationHookError`, because its KV would be stored under
        plain tokens and reused by clean calls.  The hooks must leave the stored prefix's
        positions alone (they are read, not recomputed).

        Re-entrant and thread-safe; while any thread has a block open, every call on this
        model stores nothing.

        Examples
        --------
        >>> import seqstate as ss
        >>> model = ss.models.testing.tiny()
        >>> prompt = ss.text(model)("The capital of France is", max_tokens=2)   # stored
        >>> before = model.stats
        >>> with model.frozen_store():
        ...     patched = ss.text(model)(prompt + " and", max_tokens=4)
        >>> del patched                        # its scratch KV goes with it
        >>> model.stats.kv_bytes_cached == before.kv_bytes_cached
        True
        """
        with self.backend.frozen():
            yield self

    def full_logits(self, ids: list[int]) -> Any:
        """Logits (T, V) of a fresh evaluation of ``ids`` sharing no stored KV: the reference.
        Refused (`seqstate.CapabilityError`) before any compute on an engine without
        full-vocabulary logits (a server)."""
        self.backend.capabilities.require(
            "full_logits", "model.full_logits()", "use the hf or llama.cpp engine for it",
            self.name)
        if self.closed:
            self.runner.next_logprobs()          # raises ModelClosed
        return self.backend.fresh_logits(ids)


def require_model(model: Any, taker: str) -> None:
    """`seqstate.ArgumentError` unless ``model`` is a seqstate model (``taker``: the function
    given it, as the user called it)."""
    if not isinstance(model, BaseModel):
        hint = (f" (a model's name: load it first, model = ss.models.transformers({model!r}))"
                if isinstance(model, str) else "")
        raise ArgumentError(f"{taker} takes a seqstate model (ss.models.default(), "
                            f"ss.models.transformers(...)) first, got {type(model).__name__} "
                            f"{model!r:.60}{hint}")
