"""Generator calls on an engine that runs whole requests (a `RequestBackend`: a server).

Each row becomes one streamed request; rows that are the same request (the samples of one
fork) become one request with ``n`` choices, so their prompt is sent once.  The server samples
under the row's constraint (its plugin rebuilds it from `Cursor.remote` and replays the
tokens generated under it before the call) and streams the tokens back with their raw
log-probs.  Each token goes through the row's `LiveRow` here exactly as a local step's would:
EOS rules, stop strings, the cursor after every token (so slicing back and resuming work as
on every engine), text and finish reasons.  A row that finishes here first (a stop string)
closes its request, which aborts it on the server.

Requests are engine-neutral (tokens, the call's `Sampler` and a seed, the constraint spec);
the backend writes them in its server's protocol.  Concurrent calls are concurrent requests:
the server batches them; no scheduler is involved.

Beam search (`RequestRunner.beam`) steps every live beam by a one-token request that asks for
the raw log-probs of its most likely allowed tokens (`RequestBackend.top`), then advances the
search here as an engine that steps rows does from its logits.
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from seqstate.backends.base import Completion, Handle, Scored, Token
from seqstate.constraints import spec as keys
from seqstate.constraints.base import Cursor
from seqstate.constraints.healing import MAX_HEAL_TOKENS
from seqstate.engine.beam import Beams
from seqstate.engine.rows import Decoding, LiveRow, RowRequest, RowResult
from seqstate.engine.runner import unobserved
from seqstate.engine.masks import allowed_mask
from seqstate.engine.waiting import PAUSE, POLL_SECONDS, Caller, check_interrupted
from seqstate.errors import CapabilityError, EngineError
from seqstate.finish import FinishReason
from seqstate.hooks import TOP_TOKENS, Hook, as_hook, run_hooks
from seqstate.sampling.params import BeamSearch, Greedy, Sampler

__all__ = ["RequestRunner", "spec_of", "CONCURRENCY"]

CONCURRENCY = 32         # one-token requests of a beam step in flight at once
# The finishes a server reaches on its own: a request whose rows all end so is read to its end
SERVER_SEES = frozenset({FinishReason.EOS, FinishReason.CONSTRAINT_COMPLETE,
                         FinishReason.MAX_TOKENS})


def spec_of(cursor: Cursor | None, replay: Sequence[int] = (),
            engine: str = "server") -> dict[str, Any] | None:
    """What the server's plugin needs to rebuild ``cursor``: its constraint and the tokens to
    replay through it (the constraint's own, such as a regex's sentinel, then ``replay``:
    the tokens generated under it so far).  Token healing's cursor carries its whole state
    (the bytes still to spell) and replays nothing.  ``engine`` names the engine in the
    error for a constraint that cannot be sent."""
    if cursor is None:
        return None
    remote = cursor.remote()
    if remote is None:
        raise CapabilityError(
            "this constraint cannot be sent to a server (an index compiled elsewhere has no "
            "pattern); build it with ss.regex/ss.choice/ss.json/ss.cfg", "full_logits", engine)
    if keys.HEAL in remote:
        return dict(remote)
    tokens = list(remote.get(keys.REPLAY, ())) + list(replay)
    spec = {k: v for k, v in remote.items() if k != keys.REPLAY}
    return {**spec, keys.REPLAY: tokens} if tokens else spec


@dataclasses.dataclass(frozen=True, slots=True)
class _Request:
    """One server request: the rows it carries (one per choice) and what is sent."""

    rows: tuple[int, ...]
    sent: Completion

    @classmethod
    def of(cls, i: int, row: LiveRow, before: _Request, context: int, engine: str) -> _Request:
        """The request that goes on from row ``i`` as it stands (after a hook intervened):
        its kept tokens, its cursor with every token under it replayed, its bans."""
        spec = spec_of(row.cursor, row.req.replay + tuple(row.generated), engine)
        n = len(row.tokens)
        bans = [[p - n, sorted(ids)] for p, ids in sorted(row.bans.items()) if p >= n and ids]
        if bans:
            spec = {**(spec or {}), keys.BAN: bans}
        seed = before.sent.seed       # a new draw, still determined by the call's seed
        if seed is not None:
            seed = (seed * 6364136223846793005 + n) % 2**62
        left = row.req.max_new - (len(row.generated) - row.respelled)
        return cls((i,), dataclasses.replace(
            before.sent, tokens=row.tokens, spec=spec, seed=seed, n=1,
            max_tokens=_budget(row.req, n, left, context)))


def _budget(req: RowRequest, length: int, left: int, context: int) -> int:
    """``max_tokens`` of a request for a row of ``length`` tokens that may still generate
    ``left``: healing's re-spelling tokens do not count against it; the context bounds it."""
    return min(left + (MAX_HEAL_TOKENS if req.healed_chars else 0), context - length)


class _Streams:
    """A run's requests in flight: each streamed on a thread of its own into one queue that
    `events` reads on the caller's thread.  ``current[i]`` is the request now carrying row
    ``i``; a request that no longer carries any of its rows, or whose rows are all done, is
    closed (aborted on the server); a failed request's error is kept as ``failure`` where it
    left a row unfinished (its tokens came first: rows it finished keep their results)."""

    def __init__(self, backend, rows: list[LiveRow], caller: Caller) -> None:
        self.backend, self.rows, self.caller = backend, rows, caller
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = threading.Event()
        self.current: dict[int, _Request] = {}
        self.running = 0
        self.failure: BaseException | None = None

    def send(self, request: _Request) -> None:
        for i in request.rows:
            self.current[i] = request
        self.running += 1
        threading.Thread(target=self._pump, args=(request,), daemon=True,
                         name="seqstate-request").start()

    def events(self) -> Generator[Any, None, None]:
        """Each streamed token still wanted, as (row, its request, the `Token`), until every
        request has ended; `PAUSE` to an awaiting caller while none has come, `CallTimeout`
        past its deadline."""
        caller = self.caller
        while self.running:
            try:
                kind, request, payload = (self.queue.get_nowait() if caller.awaits else
                                          self.queue.get(timeout=caller.left(POLL_SECONDS)))
            except queue.Empty:
                caller.left(POLL_SECONDS)              # past the deadline: CallTimeout
                if caller.awaits:
                    yield PAUSE
                continue
            if kind == "end":
                self.running -= 1
            elif kind == "error":
                if not all(self.rows[i].done for i in request.rows
                           if self.current[i] is request):
                    self.failure = self.failure or payload
                    self.stop.set()
            else:
                i = request.rows[payload.index]
                if (self.current[i] is request and not self.rows[i].done
                        and self.failure is None):    # else a closed request's late token
                    yield i, request, payload

    def close(self) -> None:
        """Close every request still streaming."""
        self.stop.set()

    def _pump(self, request: _Request) -> None:
        stream = self.backend.complete(request.sent)
        try:
            for token in stream:
                if (self.stop.is_set() or _abort(self.rows[i] for i in request.rows)
                        or any(self.current[i] is not request for i in request.rows)):
                    break
                self._post(("token", request, token))
        except BaseException as exc:           # handed to the caller's thread
            self._post(("error", request, exc))
        finally:
            stream.close()
            self._post(("end", request, None))

    def _post(self, event: tuple) -> None:
        self.queue.put(event)
        self.caller.wake()


class RequestRunner:
    """A model's runner on a `RequestBackend`: its calls as server requests.  It is a
    `seqstate.engine.runner.Runner`, as the scheduler
    (`seqstate.engine.scheduler.Scheduler`) is on an engine that steps rows: `run`,
    `generate`, `beam`, `score`, `next_logprobs`, `stored`."""

    def __init__(self, model) -> None:
        self.model = model

    def run(self, requests: Sequence[RowRequest], decoding: Decoding = Decoding(),
            observe: Callable[[list[LiveRow]], Sequence[Any]] = unobserved,
            caller: Caller | None = None) -> Generator[Any, None, list[RowResult]]:
        """Continue every row by server requests; yields what ``observe`` returns as tokens
        arrive (and `PAUSE` to an awaiting ``caller`` while none has), returns the results.
        Closing the generator early (a cancelled call) or the caller's deadline closes every
        request of the call, which aborts it on the server.  A failed request (the server
        unreachable, dead, refusing) raises its typed error after every other request of the
        call is closed; no state changes.  ``decoding.speculate`` changes nothing: the server
        drafts on its own.

        With ``hooks``, each row is a request of its own and its hooks see every streamed
        token (``event.logits`` is None: the server sends the token's log-prob only).  At a
        hook's first intervention the row's request is closed and a new one is sent from the
        kept tokens: a rollback drops tokens and bans the one that stood first, a resample
        bans the token at its position (the server then samples among the rest, as the local
        step does), a replacement is appended as given."""
        caller = caller or Caller()      # built here: it belongs to the run of this thread
        model = self.model
        hooks = tuple(as_hook(h) for h in decoding.hooks)
        work = self._requests(requests, decoding.sampler, decoding.rng, hooks)
        rows = [LiveRow(req, model.vocab, model.eos_token_ids) for req in requests]
        streams = _Streams(model.backend, rows, caller)
        caller.left(POLL_SECONDS)            # an interrupted run's call is refused unsent
        for request in work:
            streams.send(request)
        try:
            for event in streams.events():
                if event is PAUSE:
                    yield PAUSE
                    continue
                i, request, token = event
                if _hooked(rows[i], i, token, hooks, decoding.max_backtracks):
                    streams.send(_Request.of(i, rows[i], request, model.context_length,
                                             model.engine))
                yield from observe(rows)
        finally:
            streams.close()
        if streams.failure is not None:
            raise streams.failure
        for row in rows:
            if not row.done:            # the server ended the request without a reason we know
                row.finish(FinishReason.MAX_TOKENS)
        return [_result(model.backend, row) for row in rows]

    def generate(self, requests: Sequence[RowRequest], decoding: Decoding = Decoding()
                 ) -> list[RowResult]:
        """`run` to its end: the results (the run it belongs to may interrupt it)."""
        steps = self.run(requests, decoding, caller=Caller())
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value

    def beam(self, groups: Sequence[Sequence[tuple[RowRequest, float, int]]],
             params: BeamSearch, on_step: Callable[[], None] | None = None,
             caller: Caller | None = None
             ) -> Generator[Any, None, list[list[tuple[RowResult, float, int]]]]:
        """Beam-search each group (see `Scheduler.beam`) by one-token requests: each step
        asks the server, for every live beam at once, the raw log-probs of its `Beams.k` most
        likely tokens among those its constraint, EOS rules and bans allow (the same
        candidates an engine that steps rows takes from its logits), then advances the
        search.  A failed request raises its typed error and changes no state."""
        caller = caller or Caller()
        backend = self.model.backend
        beams = Beams(self.model, groups, params)
        size = backend.vocab_size

        def top(b) -> list[tuple[int, float]]:
            return backend.top(b.row.tokens, beams.k, allowed_mask(b.row, size))

        pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="seqstate-beam")
        try:
            while beams.live:
                asked = [pool.submit(top, b) for b in beams.live]
                answers = yield from _settled(asked, caller)
                beams.live = beams.advance(answers, lambda parent, row: _result(backend, row))
                if on_step is not None:
                    on_step()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return beams.finished

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
              store: bool = False) -> list[Scored]:
        """Teacher-forced log-probs of each pair's continuation: concurrent requests
        (`seqstate.backends.base.Backend.score`).  Refused with `Interrupted` once the run it
        belongs to was interrupted; requests already sent are answered first."""
        check_interrupted()
        return self.model.backend.score(pairs, store=store)

    def next_logprobs(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Float32 log-softmax ``(len(rows), V)`` of the next token after each row: a whole
        distribution per request (`seqstate.backends.base.RequestBackend.next_logprobs`);
        `Interrupted` as for `score`."""
        check_interrupted()
        return self.model.backend.next_logprobs(rows)

    def stored(self, rows: Sequence[Sequence[int]]) -> list[Handle]:
        """Handles on each ``row[:-1]``: what the server's prefix cache keeps."""
        return [self.model.backend.handle(len(r) - 1) for r in rows]

    def _requests(self, requests: Sequence[RowRequest], sampler: Sampler,
                  rng: torch.Generator | None, hooks: Sequence[Hook]) -> list[_Request]:
        """Rows as server requests, everything checked before any is sent.  Rows that are
        the same request (a fork's samples) share one, with ``n`` choices, unless there are
        ``hooks`` (a row's hooks may send it again alone; its tokens come with their top
        alternatives)."""
        model = self.model
        model.backend.check_sampler(sampler)
        ctx, engine = model.context_length, model.engine
        groups: dict[Any, tuple[list[int], Completion]] = {}
        for i, req in enumerate(requests):
            spec = spec_of(req.cursor, req.replay, engine)
            key = (i if hooks else None, req.tokens, json.dumps(spec, sort_keys=True),
                   req.max_new, req.healed_chars, req.stop.stops if req.stop is not None else None)
            if key in groups:
                groups[key][0].append(i)
                continue
            groups[key] = [i], Completion(req.tokens, _budget(req, len(req.tokens), req.max_new,
                                                              ctx), sampler, spec=spec,
                                          top=TOP_TOKENS if hooks else 0)
        seeds = [None] * len(groups)
        if type(sampler) is not Greedy:
            seeds = torch.randint(0, 2**62, (len(groups),), generator=rng,
                                  device="cpu" if rng is None else rng.device).tolist()
        return [_Request(tuple(rows), dataclasses.replace(sent, seed=seed, n=len(rows)))
                for (rows, sent), seed in zip(groups.values(), seeds)]


def _settled(futures: list[Future], caller: Caller) -> Generator[Any, None, list[Any]]:
    """The futures' results once all are done: a blocking caller waits for them, an
    awaiting one is yielded `PAUSE` and woken as each finishes; `CallTimeout` past the
    caller's deadline."""
    for future in futures:
        future.add_done_callback(lambda _: caller.wake())
    while pending := [f for f in futures if not f.done()]:
        wait_for = caller.left(POLL_SECONDS)
        if caller.awaits:
            yield PAUSE
        else:
            wait(pending, timeout=wait_for)
    return [f.result() for f in futures]


def _result(backend, row: LiveRow) -> RowResult:
    """A finished row's result, its handle on the KV the server's cache may hold for it."""
    return row.result(backend.handle(row.kv_valid(len(row.tokens) - 1)))


def _hooked(row: LiveRow, i: int, token: Token, hooks: Sequence[Hook], max_backtracks: int) -> bool:
    """One streamed token into row ``i`` through its hooks (`run_hooks`), as the local step
    takes a sampled one; True when the row's request must be sent again from its kept tokens
    (a hook intervened: the server samples again).  The plugin's EOS for a constraint with no
    way on is no sample: the row ends at a dead end, unhooked, as the local step ends it
    before sampling."""
    if not hooks or token.token is None or _dead_end(row, token.token):
        _accept(row, token)
        return False
    hooked = run_hooks(hooks, row, i, token.token, token.logprob, logprob_of=lambda t: None,
                       top=[(t, math.exp(lp)) for t, lp in token.top],
                       allowed=lambda t: _allowed(row, t), max_backtracks=max_backtracks,
                       sample_again=None)
    if row.done:
        return False
    if hooked.send_again:
        allowed = allowed_mask(row, row.vocab.size)
        if allowed is not None and not allowed.any():
            # every way on is banned: the row ends here, as the local step ends it (a server
            # asked to sample from nothing would send a token nothing allows)
            row.finish(FinishReason.DEAD_END)
            return False
        return True
    _accept(row, dataclasses.replace(token, token=hooked.token, logprob=hooked.logprob))
    return hooked.replaced and not row.done


def _allowed(row: LiveRow, token: int) -> bool:
    """Whether the row's constraint and bans allow ``token`` next."""
    mask = allowed_mask(row, row.vocab.size)
    return mask is None or bool(mask[token])


def _abort(rows) -> bool:
    """Whether a request's rows are all done here, one of them for a reason the server does
    not see (a stop string, a dead end): closing it aborts it.  Otherwise it is read to its
    end, a token or so later, for its usage."""
    rows = list(rows)
    return all(r.done for r in rows) and any(
        r.finish_reason not in SERVER_SEES for r in rows)


def _dead_end(row: LiveRow, token: int) -> bool:
    """Whether ``token`` is the plugin ending the row's constraint with no way on: EOS
    where the constraint is not complete."""
    return token in row.eos and row.cursor is not None and not row.cursor.accepting


def _accept(row: LiveRow, token: Token) -> None:
    """One streamed token (or a bare finish) into the row, as the local step would."""
    if token.token is not None:
        if _dead_end(row, token.token):
            row.finish(FinishReason.DEAD_END)
            return
        try:
            row.accept(token.token, token.logprob)
        except ValueError as exc:           # a token the local cursor refuses
            raise EngineError(f"the server sampled token {token.token}, which the constraint "
                              f"does not allow here ({exc}); is seqstate's plugin loaded?") from exc
    if not row.done and token.finish is not None:
        row.finish(FinishReason.MAX_TOKENS if token.finish == FinishReason.MAX_TOKENS else
                   FinishReason.EOS if row.cursor is None else FinishReason.DEAD_END)
