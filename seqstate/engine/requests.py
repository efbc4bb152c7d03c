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

from seqstate.backends.base import Handle, Scored, Token
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
from seqstate.hooks import (TOP_TOKENS, Hook, Replace, Rollback,
                            SampleEvent, as_hook, checked)
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


class _Request:
    """One server request: the rows it carries (one per choice), its prompt, its constraint
    spec, its seed (None under a greedy sampler) and its token budget."""

    def __init__(self, rows: list[int], tokens: Sequence[int], spec: dict[str, Any] | None,
                 seed: int | None, max_tokens: int) -> None:
        self.rows, self.tokens, self.spec = rows, tuple(tokens), spec
        self.seed, self.max_tokens = seed, max_tokens

    @classmethod
    def of(cls, i: int, row: LiveRow, before: _Request, context: int, engine: str) -> _Request:
        """The request that goes on from row ``i`` as it stands (after a hook intervened):
        its kept tokens, its cursor with every token under it replayed, its bans."""
        spec = spec_of(row.cursor, row.req.replay + tuple(row.generated), engine)
        n = len(row.tokens)
        bans = [[p - n, sorted(ids)] for p, ids in sorted(row.bans.items()) if p >= n and ids]
        if bans:
            spec = {**(spec or {}), keys.BAN: bans}
        seed = before.seed            # a new draw, still determined by the call's seed
        if seed is not None:
            seed = (seed * 6364136223846793005 + n) % 2**62
        left = row.req.max_new - (len(row.generated) - row.respelled)
        return cls([i], row.tokens, spec, seed, _budget(row.req, n, left, context))


def _budget(req: RowRequest, length: int, left: int, context: int) -> int:
    """``max_tokens`` of a request for a row of ``length`` tokens that may still generate
    ``left``: healing's re-spelling tokens do not count against it; the context bounds it."""
    return min(left + (MAX_HEAL_TOKENS if req.healed_chars else 0), context - length)


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
        backend, engine = model.backend, model.engine
        sampler, max_backtracks = decoding.sampler, decoding.max_backtracks
        hooks = tuple(as_hook(h) for h in decoding.hooks)
        work = self._requests(requests, sampler, decoding.rng, grouped=not hooks)
        rows = [LiveRow(req, model.vocab, model.eos_token_ids) for req in requests]
        events: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()
        current: dict[int, _Request] = {}          # row -> the request now carrying it

        def post(event: tuple) -> None:
            events.put(event)
            caller.wake()

        def pump(request: _Request) -> None:
            stream = backend.complete(request.tokens, max_tokens=request.max_tokens,
                                      sampler=sampler, seed=request.seed, spec=request.spec,
                                      n=len(request.rows), top=TOP_TOKENS if hooks else 0)
            try:
                for token in stream:
                    if (stop.is_set() or _abort(rows[i] for i in request.rows)
                            or any(current[i] is not request for i in request.rows)):
                        break
                    post(("token", request, token))
            except BaseException as exc:           # handed to the caller's thread
                post(("error", request, exc))
            finally:
                stream.close()
                post(("end", request, None))

        def send(request: _Request) -> None:
            for i in request.rows:
                current[i] = request
            threading.Thread(target=pump, args=(request,), daemon=True,
                             name="seqstate-request").start()

        caller.left(POLL_SECONDS)            # an interrupted run's call is refused unsent
        for request in work:
            send(request)
        running, failure = len(work), None
        try:
            while running:
                try:
                    kind, request, payload = (events.get_nowait() if caller.awaits else
                                              events.get(timeout=caller.left(POLL_SECONDS)))
                except queue.Empty:
                    caller.left(POLL_SECONDS)              # past the deadline: CallTimeout
                    if caller.awaits:
                        yield PAUSE
                    continue
                if kind == "end":
                    running -= 1
                    continue
                live = [i for i in request.rows if current[i] is request]
                if kind == "error":
                    # its tokens came first: rows it finished keep their results (only the
                    # request's usage is lost); one it left unfinished fails the call
                    if not all(rows[i].done for i in live):
                        failure = failure or payload
                        stop.set()
                    continue
                i = request.rows[payload.index]
                if i not in live or rows[i].done or failure is not None:
                    continue                         # a closed request's late token
                row = rows[i]
                if hooks:
                    resend = _hooked(row, i, payload, hooks, max_backtracks)
                else:
                    _accept(row, payload)
                    resend = False
                if resend and not row.done:
                    running += 1
                    send(_Request.of(i, row, request, model.context_length, engine))
                yield from observe(rows)
        finally:
            stop.set()
        if failure is not None:
            raise failure
        for row in rows:
            if not row.done:            # the server ended the request without a reason we know
                row.finish(FinishReason.MAX_TOKENS)
        return [_result(backend, row) for row in rows]

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
                  rng: torch.Generator | None, grouped: bool = True) -> list[_Request]:
        """Rows as server requests, everything checked before any is sent; ``grouped``: rows
        that are the same request (a fork's samples) share one, with ``n`` choices."""
        model = self.model
        model.backend.check_sampler(sampler)
        ctx, engine = model.context_length, model.engine
        groups: dict[Any, _Request] = {}
        for i, req in enumerate(requests):
            spec = spec_of(req.cursor, req.replay, engine)
            key = (None if grouped else i, req.tokens, json.dumps(spec, sort_keys=True),
                   req.max_new, req.healed_chars, req.stop.stops if req.stop is not None else None)
            if key in groups:
                groups[key].rows.append(i)
                continue
            groups[key] = _Request([i], req.tokens, spec, None,
                                   _budget(req, len(req.tokens), req.max_new, ctx))
        out = list(groups.values())
        if type(sampler) is not Greedy:
            seeds = torch.randint(0, 2**62, (len(out),), generator=rng,
                                  device="cpu" if rng is None else rng.device).tolist()
            for request, seed in zip(out, seeds):
                request.seed = seed
        return out


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
    """Run the hooks on one streamed token, as the local step does; True when the row's
    request must be sent again from its kept tokens (the hooks intervened).  The plugin's
    EOS for a constraint with no way on is no sample: the row ends at a dead end, unhooked,
    as the local step ends it before sampling."""
    if token.token is None or _dead_end(row, token.token):
        _accept(row, token)
        return False
    chosen, logprob, replaced = token.token, token.logprob, False
    top = [(t, math.exp(lp)) for t, lp in token.top]       # the position's, whatever is chosen
    for hook in hooks:
        event = SampleEvent(i, len(row.tokens), chosen, logprob, None, row.text,
                            row.vocab.decode([chosen]), row.generated, row.offsets,
                            lambda: row.prompt_text, top)
        action = checked(hook, hook(event), row, chosen, lambda t: _allowed(row, t),
                         max_backtracks)
        if row.done:
            return False
        if action is None:
            continue
        if isinstance(action, Replace):
            chosen, logprob, replaced = action.token, None, True
            continue
        if isinstance(action, Rollback):
            row.rollback(action.n)
        else:                                   # a resample: the server samples without them
            row.bans.setdefault(len(row.tokens), set()).update(action.ban)
        allowed = allowed_mask(row, row.vocab.size)
        if allowed is not None and not allowed.any():
            # every way on is banned: the row ends here, as the local step ends it (a server
            # asked to sample from nothing would send a token nothing allows)
            row.finish(FinishReason.DEAD_END)
            return False
        return True
    _accept(row, dataclasses.replace(token, token=chosen, logprob=logprob))
    return replaced


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
