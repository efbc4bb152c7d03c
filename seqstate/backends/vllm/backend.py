"""The ``vllm`` engine: a vLLM server behind the backend protocol.

The server has no per-step, full-vocabulary logits to give, so this backend is a
`RequestBackend` with ``full_logits=False``: the engine sends each call's rows as whole
streamed requests (`complete`) instead of stepping a `Batch`, and seqstate's constraints run
inside the server (the ``seqstate-vllm`` plugin, `seqstate.backends.vllm.vocab`).  KV lives in the
server's prefix cache; handles only remember lengths.  Scoring forces the continuation's tokens
through the plugin and reads their raw log-probs back, keeping the prefix cache.  Requests
arrive engine-neutral (a `Sampler`, the constraint spec); `sampling_of` and `complete` write
them in vLLM's names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from seqstate.backends.base import (Capabilities, Completion, RequestBackend, Scored, Token,
                                    WorkCounters)
from seqstate.backends.vllm.client import Client
from seqstate.backends.vllm.pool import Pool, Replica
from seqstate.backends.vllm.routing import BLOCK
from seqstate.backends.vllm.wire import (BOUND, FAILED, PENDING, PLUGINS, SIGNAL_KINDS, SIGNALS,
                                         vllm_xargs)
from seqstate.constraints import spec as keys
from seqstate.errors import ArgumentError, CapabilityError, ConstraintError, EngineError
from seqstate.finish import FinishReason
from seqstate.sampling.params import Greedy, Multinomial, Sampler

__all__ = ["VllmBackend", "RemoteHandle", "Replay", "Token", "sampling_of", "SCORE_CONCURRENCY",
           "MAX_LOGPROB_IDS", "VLLM_RANGES", "PENDING_WAIT"]

SCORE_CONCURRENCY = 32       # scoring requests in flight at once (vLLM batches them)
MAX_LOGPROB_IDS = 128        # vLLM's bound on one request's ``logprob_token_ids``
PENDING_WAIT = (0.01, 0.25)  # seconds before sending a request again while its constraint
                             # builds on the server: the first wait, doubling up to the last

# What the plugin's signals (`seqstate.backends.vllm.wire`) mean to the caller
_SIGNALLED = {
    FAILED: "the vLLM server could not build this constraint (its log says why); check the "
            "pattern or grammar with the same generator on a local model, which reports where "
            "it is wrong",
    BOUND: "building this constraint went over the vLLM server's bounds on time or memory "
           "(SEQSTATE_VLLM_BUILD_SECONDS, default 10 s, and SEQSTATE_VLLM_BUILD_MIB, default "
           "1024, in the server's environment): simplify it, or start the server with larger "
           "bounds",
}
_BROKE = ("the vLLM server's plugin failed on this constraint mid-way (its log says why); the "
          "call's tokens are not kept.  The same call on the hf or llama.cpp engine runs the "
          "constraint locally")


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteHandle:
    """The server keeps KV in its prefix cache, unpinned: a handle is a length."""

    length: int

    def prefix(self, n: int) -> RemoteHandle:
        return RemoteHandle(min(n, self.length))


# vLLM's own bounds on what `sampling_of` sends (``SamplingParams._verify_args``, vLLM 0.32),
# as (lowest, highest, whether each end is allowed): the server answers a value outside
# with HTTP 400 only once the request is sent.  `Multinomial` already bounds ``top_p`` and
# ``min_p`` alike (and ``top_k >= 1``, which vLLM accepts); temperature above 2, penalties
# outside [-2, 2] and an infinite repetition penalty are the engine's own limits.
VLLM_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, 2.0, True, True),
    "presence_penalty": (-2.0, 2.0, True, True),
    "frequency_penalty": (-2.0, 2.0, True, True),
    "repetition_penalty": (0.0, math.inf, False, False),
    "top_p": (0.0, 1.0, False, True),
    "min_p": (0.0, 1.0, True, True),
}


def sampling_of(sampler: Sampler) -> dict[str, Any]:
    """The sampler as vLLM's sampling parameters; `CapabilityError` for one it has not,
    `ArgumentError` for a value outside vLLM's range (`VLLM_RANGES`)."""
    if type(sampler) is Greedy:
        return {"temperature": 0.0}
    if type(sampler) is Multinomial:
        out: dict[str, Any] = {"temperature": sampler.temperature,
                               "repetition_penalty": sampler.repetition_penalty,
                               "presence_penalty": sampler.presence_penalty,
                               "frequency_penalty": sampler.frequency_penalty}
        cuts = {"top_k": sampler.top_k, "top_p": sampler.top_p, "min_p": sampler.min_p}
        out.update((name, value) for name, value in cuts.items() if value is not None)
        for name, value in out.items():
            if name in VLLM_RANGES and not _within(value, *VLLM_RANGES[name]):
                raise ArgumentError(
                    f"{name}={value!r} is outside vLLM's range {_range(*VLLM_RANGES[name])}: "
                    "the server refuses it.  Use a value in that range, or the hf or "
                    "llama.cpp engine, which take any value the sampler accepts")
        return out
    raise CapabilityError(
        f"the sampler {sampler!r} runs on next-token logits, which the server does not send; "
        "use ss.greedy() or ss.multinomial(...) there, or the hf or llama.cpp engine",
        "full_logits", "vllm")


class VllmBackend(RequestBackend):
    """Requests to vLLM servers that run seqstate's plugin: one, or a pool of replicas.

    Each request goes where `Pool` routes its tokens (`Pool.call`).  A replica that fails
    as a server mid-request (`ServerDown`) is left, and the request is sent again to the
    next, or to the same URL after a wait: tokens already streamed are not streamed twice,
    and must come back the same (greedy requests and seeded samples do), else the call
    fails with `EngineError` (`Replay`).

    Parameters
    ----------
    pool : Pool or Client
        The replicas (a `Client`: one server).
    served : str
        The model name the server answers to.
    vocab_size : int
        The tokenizer's size (logits per position, for the protocol).
    fingerprint : str
        The client's vocabulary fingerprint, sent with each constrained request.
    context_length : int
        The server's ``max_model_len``.
    signals : sequence of int
        The token ids constrained requests name as the plugin's signals
        (`seqstate.backends.vllm.vocab.signal_tokens`).
    """

    capabilities = Capabilities(name="vllm", full_logits=False, prefix_sharing=True,
                                batching=True, exact=False)

    def __init__(self, pool: Pool | Client, served: str, vocab_size: int, fingerprint: str,
                 context_length: int, signals: Sequence[int] = ()) -> None:
        self.pool = pool if isinstance(pool, Pool) else Pool([Replica(pool)], block=BLOCK)
        self.signals = list(signals)
        self.served = served
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.context_length = context_length
        self.counters = WorkCounters.zeros()
        self._count_lock = threading.Lock()

    # -- whole requests ------------------------------------------------------------------------
    def check_sampler(self, sampler: Sampler) -> None:
        """Before any request: `CapabilityError` for a sampler vLLM has not, `ArgumentError`
        naming a parameter whose value is outside vLLM's range (`sampling_of`)."""
        sampling_of(sampler)

    def complete(self, request: Completion) -> Iterator[Token]:
        """Stream one request: its ``n`` continuations sampled with its sampler (as vLLM's
        sampling parameters, `sampling_of`, with its seed), constrained by the plugin spec,
        each token with its ``top`` most likely alternatives when ``top`` > 0.  Closing the
        iterator early aborts the request on the server.  While the server builds the spec's
        regex or grammar it ends the request at once and it is sent again
        (`PENDING_WAIT`); `ConstraintError` where the server refuses the spec, cannot build
        it, goes over its bounds building it, or fails on it mid-way."""
        sampling = sampling_of(request.sampler)
        if request.seed is not None:
            sampling["seed"] = request.seed
        n, top, spec = request.n, request.top, request.spec
        body: dict[str, Any] = {
            "model": self.served, "prompt": list(request.tokens),
            "max_tokens": request.max_tokens, "n": n, "logprobs": max(1, top),
            "return_token_ids": True, "return_tokens_as_token_ids": True,
            "stream_options": {"include_usage": True}, "ignore_eos": request.ignore_eos,
            **sampling}
        signals: dict[int, str] = {}
        if spec is not None:
            if (keys.REGEX in spec or keys.GRAMMAR in spec) and self.signals:
                spec = {**spec, SIGNALS: self.signals}
                body["stop_token_ids"] = self.signals
                signals = dict(zip(self.signals, SIGNAL_KINDS))
            body["vllm_xargs"] = vllm_xargs(self.fingerprint, spec)
        wait = PENDING_WAIT[0]
        replay = Replay()
        while True:
            pending = yield from self.pool.call(
                body["prompt"], lambda replica, headers: self._attempt(
                    replica, headers, body, n, top, signals, replay))
            if not pending:
                return
            time.sleep(wait)             # the constraint is being built on the server
            wait = min(2 * wait, PENDING_WAIT[1])

    @property
    def client(self) -> Client:
        """The first replica's connection pool."""
        return self.pool.client

    def _attempt(self, replica: Replica, headers: dict[str, str], body: dict[str, Any], n: int,
                 top: int, signals: dict[int, str], replay: Replay):
        """One streamed request to ``replica``, for `Pool.call`: returns whether the server
        ended it because its constraint is still being built (send it again), having yielded
        nothing new, and the rows it computed.  Until every choice has its first token they
        are held back, so a choice that is pending never follows one that streamed.  Tokens
        already streamed by a replica that failed are checked, not yielded again (`Replay`).
        `ConstraintError` where the plugin signals that the constraint failed to build, went
        over a bound, or failed mid-way."""
        held: list[Token] | None = [] if signals else None
        started: set[int] = set()
        replay.restart(replica.name)
        with contextlib.closing(replica.stream("/v1/completions", body, headers)) as events:
            for event in events:
                if event.get("usage"):
                    self._count_usage(event["usage"])
                for choice in event.get("choices", ()):
                    kind = signals.get(choice.get("stop_reason"))
                    if kind == PENDING:
                        return True, replay.rows(body["prompt"])
                    if kind is not None:
                        raise ConstraintError(_SIGNALLED.get(kind, _BROKE))
                    tokens = list(_tokens(choice, top))
                    if held is None:
                        yield from replay.fresh(tokens)
                    elif tokens:
                        held += tokens
                        started.add(choice.get("index", 0))
                if held is not None and len(started) >= n:
                    yield from replay.fresh(held)
                    held = None
            yield from replay.fresh(held or [])
        return False, replay.rows(body["prompt"])

    def top(self, tokens: Sequence[int], k: int,
            allowed: torch.Tensor | None = None) -> list[tuple[int, float]]:
        """The ``k`` most likely next tokens after ``tokens`` among ``allowed`` (a bool mask
        over the vocabulary; None: all), best first, with their raw log-probs.  Exact in
        every case: up to 128 allowed tokens are asked for by id; otherwise the server's
        ``4k`` (at least 64) most likely are filtered, and where fewer than ``k`` of them are
        allowed, the whole distribution is read (``logprobs=-1``, a large answer).  One
        request of one token (its sampled token is dropped)."""
        ids = None if allowed is None else allowed.nonzero().flatten().tolist()
        if ids is not None and len(ids) <= MAX_LOGPROB_IDS:
            got = self._next(tokens, logprob_token_ids=ids) if ids else {}
        else:
            want = k if ids is None else min(max(4 * k, 64), self.vocab_size)
            got = self._next(tokens, logprobs=want)
            few = ids is not None and sum(bool(allowed[t]) for t in got) < k
            if few and want < self.vocab_size:
                got = self._next(tokens, logprobs=-1)
        if allowed is not None:
            got = {t: lp for t, lp in got.items() if bool(allowed[t])}
        return sorted(got.items(), key=lambda item: item[1], reverse=True)[:k]

    def next_logprobs(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Float32 log-probs ``(len(rows), V)`` of the next token after each row: one request
        per distinct row for its whole raw distribution (``logprobs=-1``: a large JSON answer
        per row), concurrent."""
        done = _concurrently(self._distribution, [tuple(r) for r in rows])
        if not rows:
            return torch.empty(0, self.vocab_size)
        return torch.stack([done[tuple(r)] for r in rows])

    def _distribution(self, tokens: Sequence[int]) -> torch.Tensor:
        got = self._next(tokens, logprobs=-1)
        out = torch.full((self.vocab_size,), float("-inf"))
        ids = [t for t in got if t < self.vocab_size]
        out[ids] = torch.tensor([got[t] for t in ids])
        return out

    def _next(self, tokens: Sequence[int], **logprobs: Any) -> dict[int, float]:
        """Raw log-probs of the next token after ``tokens``: those ``logprobs`` names
        (vLLM's ``logprobs=K`` or ``logprob_token_ids``), and the greedy token's."""
        body = {"model": self.served, "prompt": list(tokens), "max_tokens": 1,
                "temperature": 0.0, "return_tokens_as_token_ids": True,
                "logprobs": logprobs.pop("logprobs", 1), **logprobs}
        answer = self.pool.post(body["prompt"], "/v1/completions", body)
        if answer.get("usage"):
            self._count_usage(answer["usage"])
        tops = ((answer.get("choices") or [{}])[0].get("logprobs") or {}).get("top_logprobs")
        if not tops:
            raise EngineError("the vLLM server sent no log-probs for a one-token request")
        return {int(key.rpartition(":")[2]): float(lp) for key, lp in tops[0].items()}

    def handle(self, length: int) -> RemoteHandle:
        """A handle on a row's first ``length`` tokens (their KV is the server's to keep)."""
        return RemoteHandle(length)

    def _count_usage(self, usage: dict[str, Any]) -> None:
        cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        prompt = usage.get("prompt_tokens") or 0
        self.count(prefill_tokens=prompt - cached, cached_tokens_reused=cached,
                   decode_tokens=usage.get("completion_tokens") or 0, forward_calls=1)

    def count(self, **deltas: int) -> None:
        with self._count_lock:                       # requests finish on many threads
            super().count(**deltas)

    # -- scoring -------------------------------------------------------------------------------
    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
              store: bool = False) -> list[Scored]:
        """Each continuation forced token by token after its prefix (the plugin's ``force``):
        the raw log-prob of each forced token comes back, and whether it was the argmax.  The
        server's prefix cache serves every continuation of one prefix; ``store`` changes
        nothing (the server caches what it computes anyway)."""
        work = [(tuple(p), tuple(c)) for p, c in pairs]
        done = _concurrently(self._forced, [w for w in work if w[1]])
        return [done[w] if w[1] else Scored((), ()) for w in work]

    def _forced(self, pair: tuple[tuple[int, ...], tuple[int, ...]]) -> Scored:
        prefix, continuation = pair
        forced = Completion(prefix, len(continuation), Greedy(),
                            spec={keys.FORCE: list(continuation)}, ignore_eos=True)
        got = [t for t in self.complete(forced) if t.token is not None]
        if [t.token for t in got] != list(continuation):
            raise EngineError("the vLLM server did not return the forced tokens; is seqstate's "
                              "plugin loaded? (`--logits-processors` with "
                              f"{PLUGINS[False]} on vLLM's V1 model runner, "
                              f"{PLUGINS[True]} on Model Runner V2)")
        return Scored(tuple(t.logprob for t in got), tuple(t.argmax for t in got))

    def close(self) -> None:
        self.pool.close()


def _within(value: float, low: float, high: float, with_low: bool, with_high: bool) -> bool:
    return ((low <= value if with_low else low < value)
            and (value <= high if with_high else value < high))


def _range(low: float, high: float, with_low: bool, with_high: bool) -> str:
    """The interval as written in mathematics: ``[-2, 2]``, ``(0, 1]``, ``(0, inf)``."""
    return f"{'[' if with_low else '('}{low:g}, {high:g}{']' if with_high else ')'}"


def _concurrently(fn, items: Sequence[Any]) -> dict[Any, Any]:
    """``fn`` of each distinct item (hashable), up to `SCORE_CONCURRENCY` requests in flight
    at once (vLLM batches them)."""
    distinct = list(dict.fromkeys(items))
    with ThreadPoolExecutor(max_workers=max(1, min(SCORE_CONCURRENCY, len(distinct)))) as pool:
        return dict(zip(distinct, pool.map(fn, distinct)))


class Replay:
    """What one request streamed to its caller, across the replicas that served it in turn:
    one that takes over after another failed streams the request from its start, and its
    tokens up to those already streamed are checked against them, not streamed twice.  They
    must be the same (greedy requests and seeded samples are), else `EngineError`."""

    def __init__(self) -> None:
        self.sent: dict[int, list[int | None]] = {}       # choice -> the tokens yielded
        self.seen: dict[int, int] = {}                    # choice -> tokens this attempt
        self.name = ""

    def restart(self, name: str) -> None:
        """A new attempt, on the replica ``name``: its tokens count from the first again."""
        self.seen, self.name = {}, name

    def fresh(self, tokens: Sequence[Token]) -> Iterator[Token]:
        """Those of ``tokens`` (this attempt's next) not streamed before."""
        for t in tokens:
            k = self.seen.get(t.index, 0)
            self.seen[t.index] = k + 1
            done = self.sent.setdefault(t.index, [])
            if k < len(done):
                if done[k] != t.token:
                    raise EngineError(
                        f"a vLLM request failed mid-way and {self.name}, sent it again, "
                        f"answered differently at token {k} ({t.token} instead of "
                        f"{done[k]}): a sampled call is repeatable only with a seed")
                continue
            done.append(t.token)
            yield t

    def rows(self, prompt: Sequence[int]) -> list[list[int]]:
        """The prompt and each choice's tokens: what the serving replica holds now."""
        return [[*prompt, *(t for t in row if t is not None)]
                for row in (self.sent.values() or [[]])]


def _tokens(choice: dict[str, Any], keep: int = 0) -> Iterator[Token]:
    """The tokens of one streamed choice, with their raw log-probs and argmax flags (and
    their ``keep`` most likely alternatives)."""
    index = choice.get("index", 0)
    ids = choice.get("token_ids") or []
    lp = choice.get("logprobs") or {}
    own, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    finish = choice.get("finish_reason")
    for k, token in enumerate(ids):
        logprob = own[k] if k < len(own) else None
        top = tops[k] if k < len(tops) and tops[k] else {}
        best = max(top.values(), default=logprob)
        last = k == len(ids) - 1
        alternatives = () if not keep else tuple(sorted(
            ((int(key.rpartition(":")[2]), lp) for key, lp in top.items()),
            key=lambda item: item[1], reverse=True)[:keep])
        yield Token(index, token, logprob, logprob is not None and logprob >= best,
                    _finish(finish) if last else None, alternatives)
    if not ids and finish is not None:
        yield Token(index, None, None, False, _finish(finish))


def _finish(reason: str | None) -> FinishReason | None:
    """vLLM's finish reason as `Token.finish`: ``"length"`` is ``max_tokens``, any other
    (an EOS token, the plugin ending a constraint) ``stop``."""
    if reason is None:
        return None
    return FinishReason.MAX_TOKENS if reason == "length" else FinishReason.STOP
