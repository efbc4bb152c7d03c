"""The cookbook's web service (docs/cookbook/service.py) served by uvicorn on a free loopback
port and driven by real HTTP clients, on every engine: concurrent clients get the results of
sequential ones, a client that hangs up mid-stream frees its rows, a bad request gets a 4xx
with the typed error's message."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import pathlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

SERVICE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "cookbook" / "service.py"
CLIENTS = {"hf": 64, "llama.cpp": 8, "vllm": 8}      # concurrent clients per engine (time)


def service():
    spec = importlib.util.spec_from_file_location("service", SERVICE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def served(app) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port; stopped on the way out."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


def events(text: str) -> list[tuple[str, object]]:
    """Server-sent events as ``(event, data)``."""
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields["event"], json.loads(fields["data"])))
    return out


async def ask(client: httpx.AsyncClient, message: str, max_tokens: int = 8) -> list:
    reply = await client.post("/answer", json={"message": message, "max_tokens": max_tokens})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    return events(reply.text)


@pytest.fixture
def app(engine):
    return service().create_app(engine)


def test_concurrent_clients_get_the_results_of_sequential_ones(engine, app):
    messages = [f"My order number {i} has not arrived." for i in range(CLIENTS[engine.engine])]

    async def main(url):
        limits = httpx.Limits(max_connections=len(messages))
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            one_by_one = [await ask(client, m) for m in messages]
            at_once = await asyncio.gather(*(ask(client, m) for m in messages))
            return one_by_one, at_once

    with served(app) as url:
        one_by_one, at_once = asyncio.run(main(url))
    assert at_once == one_by_one
    for got in at_once:
        kinds = [kind for kind, _ in got]
        assert kinds[-3:] == ["mood", "ticket", "done"] and set(kinds[:-3]) <= {"reply"}
        ticket = dict(got)["ticket"]
        assert set(ticket) == {"topic", "urgent"} and isinstance(ticket["urgent"], bool)
        assert dict(got)["mood"] in ("positive", "neutral", "negative")


def test_a_client_that_hangs_up_frees_its_rows(engine, app):
    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            before = (await client.get("/stats")).json()
            body = {"message": "Tell me everything about your return policy.", "max_tokens": 200}
            async with client.stream("POST", "/answer", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data:"):
                        break                      # the first chunk: hang up
            deadline = time.monotonic() + 30
            while True:
                now = (await client.get("/stats")).json()
                await asyncio.sleep(0.5)
                later = (await client.get("/stats")).json()
                if (now["hung_up"] == 1 and now["decode_tokens"] == later["decode_tokens"]
                        and now["kv_bytes_held"] == before["kv_bytes_held"]):
                    return
                assert time.monotonic() < deadline, (before, now, later)

    with served(app) as url:
        asyncio.run(main(url))


def test_a_bad_request_gets_a_4xx_with_the_typed_errors_message(tiny):
    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bad_json = await client.post("/answer", content=b"{not json")
            no_message = await client.post("/answer", json={"max_tokens": 8})
            bad_max = await client.post("/answer", json={"message": "Hi", "max_tokens": 0})
            too_long = await client.post("/answer", json={"message": "Hi", "max_tokens": 10**6})
            good = await ask(client, "Hi")
            return bad_json, no_message, bad_max, too_long, good

    with served(service().create_app(tiny)) as url:
        bad_json, no_message, bad_max, too_long, good = asyncio.run(main(url))
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]
    assert no_message.status_code == 400 and "'message'" in no_message.json()["error"]
    assert bad_max.status_code == 400
    assert bad_max.json() == {"type": "ArgumentError",
                              "error": "max_tokens must be a positive int or None, got 0"}
    assert too_long.status_code == 413 and too_long.json()["type"] == "ContextOverflowError"
    assert good[-1][0] == "done"                    # the service still answers
