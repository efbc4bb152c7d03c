"""A pool of vLLM replicas as one model (`ss.models.vllm([url, ...])`), against real servers
on loopback: the session's server and one more with a small KV cache, started for this
module (and vllm-router in front of the two, `seqstate.vllm.Router`).  The reference is the
session's server alone (greedy tokens equal, scores within fp32 noise).  The second server is killed (SIGKILL) mid-stream in the module's last server
test; a replica coming back is a TCP relay in front of the session's server, closed and
opened again on the same port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import seqstate as ss
from seqstate.backends.vllm import metrics
from seqstate.backends.vllm.client import Client
from seqstate.backends.vllm.pool import RANK_HEADER
from seqstate.vllm import Router, Server, free_port

from conftest import assert_close, collect

pytestmark = pytest.mark.vllm

SMALL_KV_GIB = 0.4            # room for the session server's context (the pool checks they match)


@pytest.fixture(scope="module")
def second(vllm_server, tmp_path_factory):
    """A second server of the same weights, with a small KV cache (started after the
    session's, so a missing environment has skipped already)."""
    log = tmp_path_factory.mktemp("second") / "server.log"
    with Server(kv_cache_gib=SMALL_KV_GIB, log=open(log, "w")) as server:
        yield server


@pytest.fixture(scope="module")
def pool(vllm_server, second):
    model = ss.models.vllm([vllm_server.url, second.url])
    yield model
    model.close()


def _served(model) -> list[int]:
    return [r.served for r in model.replicas]


def _fresh(words: int = 60) -> str:
    """A prompt no server has seen (so what is cached, it cached here)."""
    tag = uuid.uuid4().hex
    return f"Notes {tag}: " + " ".join(f"item{tag[i % 32]}{i}" for i in range(words)) + "."


def _homed(model, index: int) -> str:
    """A fresh prompt whose home replica is ``index`` (as the pool's router places it)."""
    router = model.backend.pool.router
    loads = {i: 0 for i in range(len(model.replicas))}
    while True:
        prompt = _fresh()
        if router.route(model.encode_prompt(prompt), loads) == index:
            return prompt


def _equal_to_one_server(vllm, real, prompt, root, more, forks, scores, where):
    """The lineage's states (a root, its continuation, its forks, its scores) equal what one
    server gives for the same program; returns that server's root."""
    one = ss.text(vllm)
    reference = one(prompt, max_tokens=6)
    assert root.token_ids == reference.token_ids
    assert more.token_ids == one(reference + " Then", max_tokens=6).token_ids
    assert forks.token_ids == one(reference, num_samples=2, max_tokens=4,
                                  sampler=ss.multinomial(), seed=3).token_ids
    assert_close(scores.sums, reference.score([" yes", " no"]).sums, real,
                 f"scores: {where} vs one server")
    return reference


def test_a_lineage_stays_on_one_replica_with_one_servers_results(vllm, pool, real):
    prompt = _fresh()
    gen = ss.text(pool)
    before, stats = _served(pool), pool.stats
    root = gen(prompt, max_tokens=6)
    more = gen(root + " Then", max_tokens=6)                  # a continuation
    forks = gen(root, num_samples=2, max_tokens=4, sampler=ss.multinomial(), seed=3)
    beams = gen(root, max_tokens=3, sampler=ss.beam_search(2))
    scores = root.score([" yes", " no"])
    digits = ss.regex(pool, r"[0-9]{3}-[0-9]{2}")
    half = digits(root, max_tokens=3)                           # stopped mid-pattern ...
    done = digits.resume(half, max_tokens=8)                    # ... resumed where it stopped
    used = [after - b for after, b in zip(_served(pool), before)]
    assert sum(1 for u in used if u) == 1, used                 # every request: one replica
    assert (pool.stats - stats).cached_tokens_reused >= len(pool.encode_prompt(prompt)) // 2

    reference = _equal_to_one_server(vllm, real, prompt, root, more, forks, scores, "pool")
    one = ss.text(vllm)
    assert beams.token_ids == one(reference, max_tokens=3, sampler=ss.beam_search(2)).token_ids
    assert done.token_ids == ss.regex(vllm, r"[0-9]{3}-[0-9]{2}").resume(
        ss.regex(vllm, r"[0-9]{3}-[0-9]{2}")(reference, max_tokens=3), max_tokens=8).token_ids


def test_new_roots_spread_over_the_replicas_and_replicas_report_themselves(pool, vllm_server,
                                                                          second):
    before = _served(pool)
    for index in (0, 1, 1, 0):
        ss.text(pool)(_homed(pool, index), max_tokens=1)
    used = [after - b for after, b in zip(_served(pool), before)]
    assert used == [2, 2]
    report = pool.replicas
    assert [(r.url, r.rank, r.health, r.load) for r in report] == [
        (vllm_server.url, None, "up", 0), (second.url, None, "up", 0)]
    assert all(0 <= r.seen < 60 for r in report)        # each answered a request just now
    for url in (vllm_server.url, second.url):           # the load the pool reads is there
        client = Client(url)
        try:
            assert list(metrics.requests(metrics.parse(client.text("/metrics")))) == ["0"]
        finally:
            client.close()


def _finished(url: str) -> float:
    """Requests the server at ``url`` finished, by its own ``/metrics``."""
    client = Client(url)
    try:
        return metrics.total(metrics.parse(client.text("/metrics")), "vllm:request_success")
    finally:
        client.close()


def test_through_vllm_router_a_lineage_stays_on_one_server_with_one_servers_results(
        vllm, vllm_server, second, real, tmp_path):
    try:
        router = Router([vllm_server.url, second.url], "consistent_hash",
                        log=open(tmp_path / "router.log", "w"))
    except ss.ModelNotAvailable as exc:
        if os.environ.get("SEQSTATE_REQUIRE_VLLM"):
            raise
        pytest.skip(f"no vllm-router: {exc}")
    servers = [vllm_server.url, second.url]
    with router:
        model = ss.models.vllm(router.url)
        try:
            for _ in range(2):                                  # two unrelated roots
                prompt = _fresh()
                before = [_finished(url) for url in servers]
                gen = ss.text(model)
                root = gen(prompt, max_tokens=6)
                more = gen(root + " Then", max_tokens=6)          # a continuation
                forks = gen(root, num_samples=2, max_tokens=4, sampler=ss.multinomial(),
                            seed=3)
                scores = root.score([" yes", " no"])
                used = [_finished(url) - b for url, b in zip(servers, before)]
                assert sum(1 for u in used if u) == 1, used     # every request: one server
                _equal_to_one_server(vllm, real, prompt, root, more, forks, scores,
                                     "through the router")
        finally:
            model.close()


def test_a_replica_killed_mid_stream_loses_no_call_and_no_greedy_token(vllm, pool, second):
    prompts = [_homed(pool, 1) for _ in range(4)]
    expected = [ss.text(vllm)(p, max_tokens=40).token_ids for p in prompts]
    stream = ss.text(pool).stream(prompts[0], max_tokens=40)
    first = [next(stream) for _ in range(3)]                    # streaming from the second
    assert pool.replicas[1].load == 1
    with ThreadPoolExecutor(3) as others:
        running = [others.submit(ss.text(pool), p, max_tokens=40) for p in prompts[1:]]
        time.sleep(0.5)
        os.killpg(second.process.pid, signal.SIGKILL)          # dies with requests in flight
        rest, final = collect(stream)
        results = [final] + [r.result(timeout=120) for r in running]
    assert first and [s.token_ids for s in results] == expected
    assert [r.health for r in pool.replicas] == ["up", "down"]
    assert ss.text(pool)(prompts[0], max_tokens=40).token_ids == expected[0]   # on the first


class _Relay:
    """A TCP relay from a port of its own to a server: closed (every connection reset, the
    port refusing) and opened again on the same port, it is a replica going and coming back."""

    def __init__(self, port: int) -> None:
        self.target, self.port = port, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sockets: list[socket.socket] = []
        self.open()

    def open(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port), reuse_port=True)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                near, _ = listener.accept()
                far = socket.create_connection(("127.0.0.1", self.target))
                self.sockets += [near, far]
                for a, b in ((near, far), (far, near)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the thread blocked in accept()
        self.listener.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.sockets = []


def test_a_replica_that_comes_back_rejoins_and_with_none_left_calls_fail_promptly(vllm,
                                                                                   vllm_server):
    relay = _Relay(vllm_server.port)
    dead = f"http://127.0.0.1:{free_port()}"
    model = ss.models.vllm([relay.url, dead])
    try:
        assert [r.health for r in model.replicas] == ["up", "down"]
        prompt = _fresh(20)
        expected = ss.text(vllm)(prompt, max_tokens=4).token_ids
        assert ss.text(model)(prompt, max_tokens=4).token_ids == expected
        relay.close()
        start = time.monotonic()
        with pytest.raises(ss.EngineError, match="no replica of the pool"):
            ss.text(model)(prompt, max_tokens=4)
        assert time.monotonic() - start < 10
        assert [r.health for r in model.replicas] == ["down", "down"]
        relay.open()                                   # back: the next call probes and rejoins
        assert ss.text(model)(prompt, max_tokens=4).token_ids == expected
        assert [r.health for r in model.replicas] == ["up", "down"]
    finally:
        model.close()
        relay.close()
    with pytest.raises(ss.EngineError, match="no replica of the pool answers"):
        ss.models.vllm([dead, f"http://127.0.0.1:{free_port()}"])


def test_data_parallel_ranks_are_replicas_pinned_by_vllms_header(vllm_server):
    # the session's server runs one engine: rank 1 does not exist there, and vLLM says so,
    # which shows the header is sent; rank 0 serves
    model = ss.models.vllm(vllm_server.url, data_parallel_size=2)
    try:
        assert [(r.rank, r.health) for r in model.replicas] == [(0, "up"), (1, "up")]
        assert model.backend.pool.replicas[1].headers == {RANK_HEADER: "1"}
        ranks = {model.backend.pool.router.route(model.encode_prompt(p), {0: 0, 1: 0}): p
                 for p in (_fresh(30) for _ in range(12))}
        assert ss.text(model)(ranks[0], max_tokens=2).token_ids
        with pytest.raises(ss.ArgumentError, match="(?i)data.parallel"):
            ss.text(model)(ranks[1], max_tokens=2)
    finally:
        model.close()
    assert [r.rank for r in ss.models.vllm(vllm_server.url).replicas] == [None]  # read: one
