"""A web service that runs a chained program per request: a chat reply, a
choice on the conversation, then a JSON ticket, streamed as server-sent events.

Run it with uvicorn (``app`` serves the default model)::

    uvicorn docs.cookbook.service:app --port 8000

Every call is awaited (``acall``, ``astream``), so any number of requests
share the model's decode steps without a thread each; a client that hangs up
cancels its program, and its rows leave the batch at the next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import seqstate as ss

SYSTEM = "You are a support agent. Answer in one or two sentences."
MOOD = "Was the customer positive, neutral or negative? One word."
MOODS = ["positive", "neutral", "negative"]
FILE = "File a ticket as JSON."
TICKET = {"type": "object",
          "properties": {"topic": {"type": "string", "maxLength": 24},
                         "urgent": {"type": "boolean"}},
          "required": ["topic", "urgent"]}
MAX_MESSAGE = 2000          # characters of a customer's message


def sse(event: str, data: Any) -> str:
    """One server-sent event; ``data`` as JSON."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def error(message: str, status: int = 400, kind: str | None = None) -> Response:
    body = {"error": message} if kind is None else {"error": message,
                                                    "type": kind}
    return JSONResponse(body, status_code=status)


def create_app(model: Any) -> Starlette:
    """The service on ``model`` (any engine)."""
    hung_up = 0             # programs whose client went away before the end
    reply = ss.text(model)
    mood = ss.choice(model, MOODS)
    ticket = ss.json(model, TICKET)

    async def program(message: str, max_tokens: Any) -> AsyncIterator[str]:
        asked = ss.chat(model).system(SYSTEM).user(message)
        # a call seqstate refuses raises here, before any event: a 4xx
        stream = reply.astream(asked, max_tokens=max_tokens, stop_at="\n",
                               name="reply")
        first = await anext(aiter(stream), None)

        async def events() -> AsyncIterator[str]:
            nonlocal hung_up
            try:
                if first is not None:
                    yield sse("reply", first)
                    async for chunk in stream:
                        yield sse("reply", chunk)
                felt = await mood.acall(stream.state.user(MOOD), name="mood")
                yield sse("mood", felt["mood"])
                filed = await ticket.acall(felt.user(FILE), name="ticket")
                yield sse("ticket", filed["ticket"])
                yield sse("done", {"tokens": len(filed.token_ids[0][0])})
            except asyncio.CancelledError:
                # the client hung up; the call awaited here has ended its rows
                hung_up += 1
                raise

        return events()

    async def answer(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error("the body must be JSON")
        message = body.get("message") if isinstance(body, dict) else None
        if (not isinstance(message, str) or not message.strip()
                or len(message) > MAX_MESSAGE):
            return error(f"'message' must be a non-empty string of at most "
                         f"{MAX_MESSAGE} characters")
        try:
            events = await program(message, body.get("max_tokens", 64))
        except ss.ContextOverflowError as exc:       # it cannot fit: too large
            return error(str(exc), 413, type(exc).__name__)
        except ss.SeqStateError as exc:              # refused before compute
            return error(str(exc), 400, type(exc).__name__)
        return StreamingResponse(events, media_type="text/event-stream")

    async def stats(request: Request) -> Response:
        now = model.stats
        return JSONResponse({"kv_bytes_held": now.kv_bytes_held,
                             "decode_tokens": now.decode_tokens,
                             "hung_up": hung_up})

    return Starlette(routes=[Route("/answer", answer, methods=["POST"]),
                             Route("/stats", stats)])


def __getattr__(name: str) -> Any:
    """``app``: the service on the default model, built when uvicorn asks."""
    if name == "app":
        return create_app(ss.models.default())
    raise AttributeError(name)
