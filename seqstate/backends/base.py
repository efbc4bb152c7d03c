"""The backend protocol: what the generators and the decode loop need from an engine.

Two kinds of engine, two classes.  A `StepBackend` is cut at *rows*, not at
``forward(cache)``: it makes sure each row's prefix has KV (computing only what no stored
prefix covers), runs one token per working row and returns next-token logits, forgets a row's
trailing KV (rollback), copies rows (beam search) and stores a finished row's KV so later
states reuse it; seqstate samples each token.  A `RequestBackend` is a server that runs whole
requests (seqstate's constraints inside it) and streams their tokens back.  Both score whole
continuations and keep the counters `Backend` declares.  How KV is kept is the backend's
business: torch segments in a radix store (``hf``), sequences sharing cells inside llama.cpp
(``llamacpp``), or a remote server's prefix cache (no store on this side).

Handles
    A handle names the KV of the first ``length`` tokens of one row's token path.  States hold
    handles, but stored KV is a cache, not a lease: the backend drops the least recently used
    under pressure, whether a state refers to it or not, and computes it again from the
    tokens when it is next needed (only KV that work in progress uses is kept).
    ``handle.prefix(n)`` is a handle on the first ``n`` tokens (slicing back).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from seqstate.errors import CacheFullError, CapabilityError
from seqstate.finish import FinishReason

__all__ = ["Capabilities", "WorkCounters", "Handle", "Scored", "Token", "Completion", "Fed",
           "Batch", "Backend",
           "StepBackend", "RequestBackend", "CacheFullError",
           "openmp", "torch_threads", "single_threaded_torch", "free_cpus"]


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do; generators raise a typed error naming a missing capability.

    Attributes
    ----------
    name
        the engine's name, for messages (``"hf"``, ``"llama.cpp"``, ``"vllm"``).
    full_logits
        next-token logits over the whole vocabulary at every step (``model.full_logits()``,
        samplers that read them); every `StepBackend` has them, a `RequestBackend` may not.
    prefix_sharing
        token-level KV sharing between rows (forks store a prefix once).
    batching
        several rows run in one forward.
    exact
        logits equal a fresh fp32 evaluation to fp32 noise (the exactness reference).
    max_rows
        most working rows one batch can hold at once (None: no fixed limit).
    activations
        a forward whose activations can be read and patched by hook name
        (``state.run_with_cache``, ``state.with_hooks``): the engine runs the model's
        modules itself (hf).
    own_threads
        the engine computes on CPU threads of its own; its ``on_worker_start`` then makes the
        sampling step (torch ops over a few rows of logits) run single-threaded on the
        scheduler's worker instead of waking torch's thread team to compete with the
        engine's (a team spinning beside llama.cpp's threads slows its decode).
    """

    name: str
    full_logits: bool = True
    prefix_sharing: bool = True
    batching: bool = True
    exact: bool = False
    max_rows: int | None = None
    own_threads: bool = False
    activations: bool = False

    def require(self, capability: str, feature: str, instead: str, model: str) -> None:
        """Raise `CapabilityError` when this engine lacks ``capability`` (``"full_logits"``,
        ``"prefix_sharing"`` or ``"batching"``), which ``feature`` of ``model`` needs;
        ``instead`` says what to do."""
        if not getattr(self, capability):
            raise CapabilityError(
                f"the engine capability {capability!r} ({_MEANING[capability]}) is needed for "
                f"{feature}, and the {self.name!r} engine of {model!r} does not have it; "
                f"{instead}", capability, self.name)


_MEANING = {
    "full_logits": "next-token logits over the whole vocabulary",
    "prefix_sharing": "rows sharing the KV of a common prefix",
    "batching": "several rows in one forward",
    "activations": "reading and patching the model's activations by hook name",
}


@dataclasses.dataclass(frozen=True, slots=True)
class WorkCounters:
    """The work counters every engine keeps, declared once: a backend's ``counters`` is a dict
    of these names (`zeros`), and the model's ``stats`` are these plus its KV accounting."""

    prefill_tokens: int = 0          # tokens whose KV was computed in a prefill forward
    recomputed_tokens: int = 0       # of those, computed again: a live state's KV was evicted
    decode_tokens: int = 0           # tokens fed one-per-row in decode steps
    cached_tokens_reused: int = 0    # tokens whose KV came from the store instead of a forward
    forward_calls: int = 0
    draft_tokens_accepted: int = 0   # speculation: drafted tokens the sampler chose too
    draft_tokens_rejected: int = 0   # drafted tokens fed but not chosen (their KV dropped)

    @classmethod
    def zeros(cls) -> dict[str, int]:
        """A new backend's ``counters``: every counter at 0."""
        return {field.name: 0 for field in dataclasses.fields(cls)}


@runtime_checkable
class Handle(Protocol):
    """A reference to the KV of the first ``length`` tokens of a row (a state's: the KV may
    be evicted meanwhile and is then computed again)."""

    @property
    def length(self) -> int: ...

    def prefix(self, n: int) -> Handle:
        """A handle on the first ``n`` tokens (clipped to ``length``)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class Scored:
    """One continuation scored after one prefix.

    Attributes
    ----------
    logprobs
        the log-prob of each continuation token at its position.
    argmax
        per token: it is the most likely token at its position.
    """

    logprobs: tuple[float, ...]
    argmax: tuple[bool, ...]

    @property
    def greedy(self) -> bool:
        """Every token is the argmax at its position (greedy decoding would produce it)."""
        return all(self.argmax)


@dataclasses.dataclass(frozen=True, slots=True)
class Token:
    """One token of a streamed request (`RequestBackend.complete`): which of its ``n``
    choices, the token, its raw log-prob, whether it is the most likely token there, and the
    choice's finish (on its last token, or on an empty final event: ``token`` None):
    `FinishReason.MAX_TOKENS` where the request's ``max_tokens`` ran out,
    `FinishReason.STOP` where the server ended it (an EOS token, or the constraint with no
    way on); ``top``: the most likely tokens there with their raw log-probs, best first,
    when the request asked."""

    index: int
    token: int | None
    logprob: float | None
    argmax: bool
    finish: FinishReason | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """One whole request, engine-neutral, that `RequestBackend.complete` takes whole (as the
    step takes its call's `seqstate.engine.rows.Decoding`): ``n`` continuations of
    ``tokens``, each of at most ``max_tokens`` tokens, sampled with ``sampler`` (a
    `seqstate.sampling.params.Sampler`; ``seed``: the server's seed for them, None with a
    greedy sampler) under ``spec``, the constraint the server runs
    (`seqstate.constraints.spec`: a cursor's ``remote()``, the tokens to replay, tokens
    banned at positions past the prompt); ``ignore_eos``: go on past EOS; ``top``: send
    each token's ``top`` most likely alternatives with it.

    Examples
    --------
    >>> import seqstate as ss
    >>> from seqstate.backends.base import Completion
    >>> Completion([1, 2, 3], 8, ss.greedy()).tokens
    (1, 2, 3)
    """

    tokens: tuple[int, ...]
    max_tokens: int
    sampler: Any
    seed: int | None = None
    spec: dict[str, Any] | None = None
    n: int = 1
    ignore_eos: bool = False
    top: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))


@dataclasses.dataclass(frozen=True, slots=True)
class Fed:
    """The logits `Batch.extend` returns: every fed token's as one tensor, in slot order or
    not, and where each slot's rows are.  ``fed[j]`` is slot ``j``'s ``(len(feeds[j]), V)``
    (a view), ``fed[a:b]`` the same for those slots only."""

    logits: torch.Tensor             # (N, V)
    starts: tuple[int, ...]          # per slot: its first row in ``logits``
    lengths: tuple[int, ...]         # per slot: how many tokens it was fed

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, j: int | slice) -> torch.Tensor | Fed:
        if isinstance(j, slice):
            return Fed(self.logits, self.starts[j], self.lengths[j])
        return self.logits[self.starts[j]: self.starts[j] + self.lengths[j]]


@runtime_checkable
class Batch(Protocol):
    """Working rows ("slots") that run together, one token per slot per forward.

    Slots are ids, stable for their life: rows of any number of calls join (``add``) and
    leave (``release``) while others keep running, which is how concurrent calls share
    decode steps.  A slot holds the KV of a prefix of its row.
    """

    def add(self, rows: Sequence[Sequence[int]], grow_by: int) -> list[int]:
        """New slots holding the KV of each ``row[:-1]``, computing only what no stored prefix
        covers (shared uncached prefixes of these rows once).  ``grow_by`` is how many tokens
        each may still grow by."""
        ...

    def forward(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens[j]`` to ``slots[j]`` at that slot's next position (all in one batch).

        Returns float32 next-token logits ``(len(slots), V)``.  Each slot's KV grows by one.
        """
        ...

    def extend(self, slots: Sequence[int], feeds: Sequence[Sequence[int]]) -> Fed:
        """Feed ``feeds[j]`` (one or more tokens) to ``slots[j]``, all in one batch.

        Returns float32 logits of every fed token as one `Fed`: slot ``j``'s
        ``(len(feeds[j]), V)`` are the next-token logits after each token it was fed.  Each slot's KV grows by ``len(feeds[j])``; speculation verifies a
        draft this way, then `truncate()` drops what the sampler did not accept.
        """
        ...

    def length(self, slot: int) -> int:
        """Tokens of the slot's row whose KV the slot holds."""
        ...

    def truncate(self, slot: int, length: int) -> None:
        """Forget the slot's KV past its first ``length`` tokens (a hook's rollback)."""
        ...

    def fork(self, slot: int) -> int:
        """A new slot continuing ``slot`` (beam search); their common KV is shared."""
        ...

    def release(self, slot: int) -> None:
        """Drop the slot (committed KV stays in the store)."""
        ...

    def commit(self, slot: int, tokens: Sequence[int], length: int) -> Handle:
        """Store the slot's KV of ``tokens[:length]`` so later rows reuse it; a handle for a
        state (the KV stays while there is room, least recently used goes first)."""
        ...

    def close(self) -> None:
        """Release every slot."""
        ...


@runtime_checkable
class Backend(Protocol):
    """What every engine has and a model uses, whatever its kind.  One per model; calls are
    serialised by the model's runner.  An engine subclasses one of the two kinds,
    `StepBackend` or `RequestBackend` (the model picks its runner by the kind), and inherits
    ``count``, ``frozen``, ``on_worker_start`` and ``close`` from here.

    ``store`` is the engine's store of KV (a radix store, with ``freeze()``), or None where
    nothing is stored on this side (a server keeps KV in its own prefix cache).
    """

    capabilities: Capabilities
    counters: dict[str, int]          # `WorkCounters.zeros()`, counted up by `count`
    vocab_size: int                   # logits per position
    context_length: int               # positions the model takes (its trained context)
    store: Any = None
    # where its logits live: host memory where a library or a server hands them over
    device: torch.device = torch.device("cpu")

    def kv_stats(self) -> dict[str, int]:
        """KV accounting for the model's ``stats``: ``kv_bytes_held``, ``kv_bytes_cached``,
        ``evictions``, ``live_evictions``, ``segments``."""
        ...

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
              store: bool = False) -> list[Scored]:
        """Teacher-forced log-probs of each ``(prefix, continuation)`` pair's continuation
        tokens, and whether each is the argmax at its position.  Each distinct prefix is
        computed once (its KV stored, as a row's) and its last position serves every
        continuation's first token; continuation KV is scratch unless ``store`` (then each
        ``prefix + continuation[:-1]`` is stored, unpinned).  Memory is bounded by a token
        budget, not by the number of pairs (`seqstate.backends.teacher_forcing`)."""
        ...

    def count(self, **deltas: int) -> None:
        """Add to the work counters (the model's ``stats``)."""
        for name, value in deltas.items():
            self.counters[name] += value

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """A block in which the store is read and nothing is written to it (the model's
        ``frozen_store()``); with no store on this side, there is nothing to freeze."""
        if self.store is None:
            yield
            return
        with self.store.freeze():
            yield

    def on_worker_start(self) -> None:
        """Called on the scheduler's worker thread when it starts, before any step: per-thread
        setup (an engine computing on threads of its own makes torch single-threaded there,
        `single_threaded_torch`).  Nothing by default."""

    def close(self) -> None:
        """Let go of what the engine holds outside this process (connections).  Nothing by
        default."""


@runtime_checkable
class StepBackend(Backend, Protocol):
    """An engine that steps rows: seqstate feeds a `Batch` of rows one token at a time and
    samples each next token from full-vocabulary logits (so ``capabilities.full_logits`` is
    True by definition).  ``store`` is its radix store of KV."""

    def batch(self) -> Batch:
        """A new, empty batch."""
        ...

    def fresh_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits ``(T, V)`` of a fresh evaluation of ``tokens`` sharing no stored KV."""
        ...


@runtime_checkable
class RequestBackend(Backend, Protocol):
    """An engine that runs whole requests (a server, seqstate's constraints inside it): a
    call's rows go to `complete` as requests instead of stepping a `Batch`.  Nothing is
    stored on this side (``store`` None); requests are engine-neutral (token ids, a
    `seqstate.sampling.params.Sampler`, the constraint's `seqstate.constraints.Cursor.remote`
    spec) and the backend translates them to its server's protocol."""

    def check_sampler(self, sampler: Any) -> None:
        """Raise `CapabilityError`, before any request, for a sampler the server cannot run."""
        ...

    def complete(self, request: Completion) -> Iterator[Token]:
        """Stream the ``request.n`` continuations of a `Completion` as `Token` s, each with
        its ``request.top`` most likely alternatives when that is > 0.  Closing the iterator
        early aborts the request."""
        ...

    def next_logprobs(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Float32 log-softmax ``(len(rows), V)`` of the next token after each row (an
        engine that steps rows reads it in its running batch instead:
        `seqstate.engine.logprob_jobs.NextJob`)."""
        ...

    def top(self, tokens: Sequence[int], k: int,
            allowed: torch.Tensor | None = None) -> list[tuple[int, float]]:
        """The ``k`` most likely next tokens after ``tokens`` among ``allowed`` (bool, over
        the vocabulary; None: all), best first, with their log-probs over the whole
        vocabulary: a beam's step."""
        ...

    def handle(self, length: int) -> Handle:
        """A handle on a finished row's first ``length`` tokens."""
        ...

    def kv_stats(self) -> dict[str, int]:
        """The KV is the server's: nothing is held or cached on this side."""
        return {"kv_bytes_held": 0, "kv_bytes_cached": 0, "evictions": 0, "live_evictions": 0,
                "segments": 0}


def openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch computes with (its ``omp_*`` functions), or None without one."""
    lib = ctypes.CDLL(None)
    return lib if hasattr(lib, "omp_set_num_threads") else None


def torch_threads(n: int) -> None:
    """Make torch's ops on the calling thread alone run on at most ``n`` threads (at least 1).

    ``torch.set_num_threads`` would change every thread started later too; OpenMP's own
    ``omp_set_num_threads`` sets the calling thread's team size only.  torch sets it once per
    thread, lazily, so that happens first.  A torch without OpenMP is left as it is.
    """
    torch.get_num_threads()
    omp = openmp()
    if omp is not None:
        omp.omp_set_num_threads(max(1, min(n, omp.omp_get_max_threads())))


def single_threaded_torch() -> None:
    """Make torch's ops on the calling thread alone single-threaded (`torch_threads`)."""
    torch_threads(1)


def free_cpus() -> int:
    """CPUs of this process's affinity that no other process's runnable thread holds now
    (at least 1): the kernel's count of runnable threads (``/proc/loadavg``) less this
    process's own.  A sample, not an average: ``os.getloadavg()`` lags by a minute, and an
    OpenMP team of more threads than free CPUs waits at every barrier for a thread the
    scheduler has parked behind another process.  Where ``/proc`` cannot be read, every CPU
    counts as free."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        own = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/stat") as f:
                own += f.read().rpartition(")")[2].split()[0] == "R"
    except (OSError, ValueError, IndexError):
        return cpus
    return max(1, cpus - max(0, running - own))
