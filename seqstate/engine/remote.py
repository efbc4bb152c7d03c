"""Generator calls on an engine that runs whole requests (a server: ``steps=False``).

Each row becomes one streamed request; rows that are the same request (the samples of one
fork) become one request with ``n`` choices, so their prompt is sent once.  The server samples
under the row's constraint (seqstate's plugin rebuilds it from `Cursor.remote` and replays the
tokens generated under it before the call) and streams the tokens back with their raw
log-probs.  Each token goes through the row's `LiveRow` here exactly as a local step's would:
EOS rules, stop strings, the cursor after every token (so slicing back and resuming work as
on every engine), text and finish reasons.  A row that finishes here first (a stop string)
closes its request, which aborts it on the server.

Concurrent calls are concurrent requests: the server batches them; no scheduler is involved.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from seqstate.constraints.healing import MAX_HEAL_TOKENS
from seqstate.engine.rows import LiveRow, RowRequest, RowResult
from seqstate.errors import CapabilityError, EngineError
from seqstate.sampling.params import Greedy, Multinomial, Sampler

__all__ = ["run", "sampling_of", "spec_of"]


def sampling_of(sampler: Sampler) -> dict[str, Any]:
    """The sampler as vLLM's sampling parameters; `CapabilityError` for one it has not."""
    if type(sampler) is Greedy:
        return {"temperature": 0.0}
    if type(sampler) is Multinomial:
        out: dict[str, Any] = {"temperature": sampler.temperature,
                               "repetition_penalty": sampler.repetition_penalty,
                               "presence_penalty": sampler.presence_penalty,
                               "frequency_penalty": sampler.frequency_penalty}
        cuts = {"top_k": sampler.top_k, "top_p": sampler.top_p, "min_p": sampler.min_p}
        return {**out, **{name: value for name, value in cuts.items() if value is not None}}
    raise CapabilityError(
        f"the sampler {sampler!r} runs on next-token logits, which the server does not send; "
        "use ss.greedy() or ss.multinomial(...) there, or the hf or llama.cpp engine",
        "full_logits", "vllm")


def spec_of(req: RowRequest) -> dict[str, Any] | None:
    """What the server's plugin needs to rebuild the row's cursor: the constraint, and the
    tokens to replay (its own, such as a regex's sentinel, then the row's)."""
    if req.cursor is None:
        return None
    remote = req.cursor.remote()
    if remote is None:
        raise CapabilityError(
            "this constraint cannot be sent to a server (an index compiled elsewhere has no "
            "pattern); build it with ss.regex/ss.choice/ss.json/ss.cfg", "full_logits", "vllm")
    replay = list(remote.get("replay", ())) + list(req.replay)
    spec = {k: v for k, v in remote.items() if k != "replay"}
    return {**spec, "replay": replay} if replay else spec


class _Request:
    """One server request: the rows it carries (one per choice) and its parameters."""

    def __init__(self, rows: list[int], req: RowRequest, spec: dict[str, Any] | None,
                 sampling: dict[str, Any], max_tokens: int) -> None:
        self.rows, self.req, self.spec = rows, req, spec
        self.sampling, self.max_tokens = sampling, max_tokens


def _requests(model, requests: Sequence[RowRequest], sampler: Sampler,
              rng: torch.Generator | None) -> list[_Request]:
    """Rows grouped into server requests, everything checked before any is sent."""
    sampling = sampling_of(sampler)
    ctx = model.context_length
    groups: dict[Any, _Request] = {}
    for i, req in enumerate(requests):
        spec = spec_of(req)
        key = (req.tokens, json.dumps(spec, sort_keys=True), req.max_new, req.healed,
               req.stop.stops if req.stop is not None else None)
        if key in groups:
            groups[key].rows.append(i)
            continue
        room = ctx - len(req.tokens)
        max_tokens = min(req.max_new + (MAX_HEAL_TOKENS if req.healed else 0), room)
        groups[key] = _Request([i], req, spec, sampling, max_tokens)
    out = list(groups.values())
    if type(sampler) is not Greedy:
        seeds = torch.randint(0, 2**62, (len(out),), generator=rng).tolist()
        for request, seed in zip(out, seeds):
            request.sampling = {**request.sampling, "seed": seed}
    return out


def run(model, requests: Sequence[RowRequest], sampler: Sampler,
        rng: torch.Generator | None,
        observe: Callable[[list[LiveRow]], Sequence[Any]] = lambda rows: ()
        ) -> Generator[Any, None, list[RowResult]]:
    """Continue every row by server requests; yields what ``observe`` returns as tokens
    arrive, returns the results.  A failed request (the server unreachable, dead, refusing)
    raises its typed error after every other request of the call is closed; no state
    changes."""
    backend = model.backend
    work = _requests(model, requests, sampler, rng)
    rows = [LiveRow(req, model.vocab, model.eos_token_ids) for req in requests]
    events: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def pump(request: _Request) -> None:
        stream = backend.complete(request.req.tokens, max_tokens=request.max_tokens,
                                  sampling=request.sampling, spec=request.spec,
                                  n=len(request.rows))
        try:
            for token in stream:
                if stop.is_set() or _abort(rows[i] for i in request.rows):
                    break
                events.put(("token", request.rows[token.index], token))
        except BaseException as exc:           # handed to the caller's thread
            events.put(("error", request, exc))
        finally:
            stream.close()
            events.put(("end", None, None))

    threads = [threading.Thread(target=pump, args=(r,), daemon=True, name="seqstate-vllm")
               for r in work]
    for t in threads:
        t.start()
    running, failure = len(threads), None
    try:
        while running:
            kind, i, payload = events.get()
            if kind == "end":
                running -= 1
            elif kind == "error":
                # its tokens came first: rows it finished keep their results (only the
                # request's usage is lost); one it left unfinished fails the call
                if not all(rows[r].done for r in i.rows):
                    failure = failure or payload
                    stop.set()
            elif not rows[i].done and failure is None:
                _accept(rows[i], payload)
                items = observe(rows)
                if items:
                    yield items
    finally:
        stop.set()
    if failure is not None:
        raise failure
    for row in rows:
        if not row.done:            # the server ended the request without a reason we know
            row.finish("max_tokens")
    return [row.result(backend.handle(min(len(row.tokens) - 1, row.kv_limit))) for row in rows]


def _abort(rows) -> bool:
    """Whether a request's rows are all done here, one of them for a reason the server does
    not see (a stop string, a dead end): closing it aborts it.  Otherwise it is read to its
    end, a token or so later, for its usage."""
    rows = list(rows)
    return all(r.done for r in rows) and any(
        r.finish_reason not in ("eos", "constraint_complete", "max_tokens") for r in rows)


def _accept(row: LiveRow, token) -> None:
    """One streamed token (or a bare finish) into the row, as the local step would."""
    if token.token is not None:
        if token.token in row.eos and row.cursor is not None and not row.cursor.accepting:
            row.finish("dead_end")          # the plugin ends a constraint with no way on
            return
        try:
            row.accept(token.token, token.logprob)
        except ValueError as exc:           # a token the local cursor refuses
            raise EngineError(f"the server sampled token {token.token}, which the constraint "
                              f"does not allow here ({exc}); is seqstate's plugin loaded?") from exc
    if not row.done and token.finish is not None:
        row.finish("max_tokens" if token.finish == "length" else
                   "eos" if row.cursor is None else "dead_end")
