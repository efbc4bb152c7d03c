"""The pool's routing rules, health states and failover, without vLLM servers
(`seqstate.backends.vllm.routing`, `seqstate.backends.vllm.pool`): replicas are stand-ins,
and a cut stream comes from a stand-in HTTP server on loopback."""

from __future__ import annotations

import contextlib
import http.server
import json
import random
import threading
import time

import pytest

import seqstate as ss
from seqstate.backends.vllm import metrics
from seqstate.backends.vllm import pool as pool_module
from seqstate.backends.base import Completion
from seqstate.backends.vllm.backend import VllmBackend
from seqstate.backends.vllm.client import Client, ServerDown
from seqstate.backends.vllm.pool import PROBE_AFTER, SESSION_HEADER, Health, Pool, Replica
from seqstate.backends.vllm.routing import (LINEAGE_SPILL, Lineage, Router, Sessions,
                                           block_hashes, rendezvous)
from seqstate.vllm import free_port
from seqstate.finish import FinishReason

IDLE = {0: 0, 1: 0, 2: 0}


def _tokens(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(50_000), k=n)


def test_block_hashes_are_shared_exactly_as_far_as_whole_blocks_are():
    a = _tokens(0, 100)
    b = a[:70] + _tokens(1, 30)
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 100 // 16 and len(block_hashes(a[:15], 16)) == 0
    assert ha[:4] == hb[:4] and ha[4] != hb[4]          # 64 tokens shared, the 5th block not
    assert block_hashes(a[:64], 16) == ha[:4]            # a prefix's hashes are its own


def test_continuations_forks_and_scores_follow_their_prefix():
    router = Router(block=16)
    for seed in range(30):
        root = _tokens(seed, 200)
        home = router.route(root, IDLE)
        router.record(root, home)
        generated = root + _tokens(100 + seed, 40)
        router.record(generated, home, generated_from=len(root))
        assert router.route(root, IDLE) == home                      # a fork (same prompt)
        assert router.route(generated + [5, 6, 7], IDLE) == home     # its continuation
        assert router.route(root[:180] + [9] * 5, IDLE) == home      # a slice, then a score
        # where the home is busier than the rest, a lineage stays up to its own threshold
        busy = {r: (LINEAGE_SPILL if r == home else 0) for r in IDLE}
        assert router.route(generated + [1], busy) == home
        # past it, it moves to the least loaded (a wide fork of a long state), and its
        # continuations follow it there
        busy = {r: (LINEAGE_SPILL + 1 if r == home else 3 if r == (home + 1) % 3 else 0)
                for r in IDLE}
        moved = router.route(generated + [1], busy)
        assert moved == (home + 2) % 3
        router.record(generated + [1], moved)
        assert router.route(generated + [1, 2], IDLE) == moved
        # a new root that extends the prompt alone (a chat behind a shared system prompt)
        # is not a state's continuation: it spills past spill, as any new root
        chat = root + _tokens(200 + seed, 10)
        assert router.route(chat, {r: (5 if r == moved else 0) for r in IDLE}) != moved
        assert router.route(chat, {r: (4 if r == moved else 0) for r in IDLE}) == moved


def test_a_new_root_goes_home_the_same_on_every_client_and_spills_only_past_the_threshold():
    names = {0: "http://a:8000", 1: "http://b:8000", 2: "http://c:8000"}
    one, two = Router(16, spill=4, names=names), Router(16, spill=4, names=names)
    homes = [one.route(_tokens(s, 64), IDLE) for s in range(60)]
    assert homes == [two.route(_tokens(s, 64), IDLE) for s in range(60)]
    assert set(homes) == {0, 1, 2}                         # spread over the replicas
    root = _tokens(7, 64)
    home = one.route(root, IDLE)
    other = (home + 1) % 3
    assert one.route(root, {**IDLE, home: 4}) == home      # uneven, within the threshold
    spilled = one.route(root, {r: 5 if r == home else 9 if r == other else 0 for r in IDLE})
    assert spilled not in (home, other)                    # past it: the least loaded


def test_a_root_sharing_a_short_head_is_a_new_root_and_one_sharing_most_is_not():
    router = Router(block=16)
    document = _tokens(1, 320)
    router.record(document + _tokens(2, 20), 2)
    assert router.route(document + _tokens(3, 60), IDLE) == 2          # shares most: lineage
    # shares one block of 20: a new root, placed where it shares that block unless uneven
    short = document[:16] + _tokens(4, 300)
    assert router.route(short, IDLE) == 2
    assert router.route(short, {0: 0, 1: 0, 2: 9}) != 2


def test_rendezvous_moves_only_the_keys_of_a_replica_that_leaves():
    names = {i: f"http://10.0.0.{i}:8000" for i in range(4)}
    keys = [bytes([k % 256, k // 256]) for k in range(400)]
    before = {k: rendezvous(k, [0, 1, 2, 3], names) for k in keys}
    after = {k: rendezvous(k, [0, 1, 3], names) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != 2)
    assert all(after[k] != 2 for k in keys)


def test_a_lineage_on_a_replica_that_cannot_serve_goes_elsewhere_and_stays_there():
    router = Router(block=16)
    root = _tokens(3, 100)
    router.record(root, 1)
    moved = router.route(root + [1], {0: 0, 2: 0})      # 1 is down
    assert moved in (0, 2)
    router.record(root + [1], moved)
    assert router.route(root + [1, 2], IDLE) == moved    # 1 rejoined: the lineage moved


def test_the_lineage_forgets_the_least_recently_used_blocks_first():
    lineage = Lineage(capacity=8)
    a, b = block_hashes(_tokens(1, 64), 16), block_hashes(_tokens(2, 96), 16)
    lineage.record(a, 0)
    lineage.record(b, 1)
    assert len(lineage) == 8
    assert lineage.longest(a, IDLE) == (0, -1)           # a's first blocks went first
    assert lineage.longest(b, IDLE) == (6, 1)
    with pytest.raises(ValueError):
        Router(16).route([1, 2], {})


def test_health_goes_down_waits_doubling_and_comes_back():
    now = [100.0]
    health = Health(clock=lambda: now[0])
    assert health.up and not health.due()
    waits = []
    for _ in range(8):
        health.fail("connection refused")
        waits.append(health.retry_at - now[0])
    assert waits[:3] == [PROBE_AFTER[0], 2 * PROBE_AFTER[0], 4 * PROBE_AFTER[0]]
    assert max(waits) == PROBE_AFTER[1] and not health.up and not health.due()
    now[0] += PROBE_AFTER[1]
    assert health.due() and health.reason == "connection refused"
    health.succeed()
    assert health.up and not health.due() and health.failures == 0
    # its age: how long ago an answer (or a failure) last said it
    assert health.age() == 0.0
    now[0] += 42.0
    assert health.age() == 42.0 and Health(clock=lambda: now[0]).age() is None


def test_metrics_name_the_engines_the_block_size_and_the_cache_counters():
    text = "\n".join([
        "# TYPE vllm:prefix_cache_queries_total counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0',
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 320.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0',
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0"} 1.0'])
    samples = metrics.parse(text)
    assert metrics.total(samples, "vllm:prefix_cache_queries") == 960.0
    assert metrics.total(samples, "vllm:prefix_cache_hits") == 512.0
    assert (metrics.engines(samples), metrics.block_size(samples)) == (2, 32)
    assert (metrics.engines([]), metrics.block_size([])) == (1, None)


class _Client:
    """A stand-in for `Client` where only its ``/health`` and ``/metrics`` matter (`Pool`
    asks no more): it counts its ``probes``, runs ``during`` (once) while the first is in
    flight, and answers ``/metrics`` with ``page``."""

    def __init__(self, url: str, alive: bool = True) -> None:
        self.url, self.up = url, alive
        self.probes = 0
        self.during = None
        self.page = ""

    def text(self, path: str) -> str:
        assert path == "/metrics"
        if not self.up:
            raise ServerDown(f"{self.url} did not answer")
        return self.page

    def alive(self) -> bool:
        self.probes += 1
        during, self.during = self.during, None
        if during is not None:
            during()
        return self.up

    def close(self) -> None:
        pass


def _pool(n: int = 3, clock=time.monotonic) -> Pool:
    return Pool([Replica(_Client(f"http://10.0.0.{i}:8000"), clock=clock) for i in range(n)],
                block=16, waits=(0.0,))


def _request(pool: Pool, tokens: list[int]) -> Replica:
    """The replica a request of ``tokens`` goes to (probing what is due first)."""
    attempts = pool.attempts(tokens)
    try:
        return next(attempts)
    finally:
        attempts.close()


def test_a_new_root_spills_by_the_servers_own_load_read_from_metrics(monkeypatch):
    """Other clients' requests count: a server whose /metrics shows requests running and
    waiting past ``spill`` takes no new root; the reading is renewed every LOAD_EVERY s."""
    def home_of(seed: int) -> int:
        idle = _pool()
        return idle.replicas.index(_request(idle, _tokens(seed, 64)))

    homes = {s: home_of(s) for s in range(20)}
    first, second, third = [s for s in homes if homes[s] == homes[0]][:3]  # one home's roots
    pool = _pool()
    home = pool.replicas[homes[0]]
    home.client.page = ('vllm:num_requests_running{engine="0",model_name="m"} 6.0\n'
                        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n')
    assert _request(pool, _tokens(first, 64)) is not home and home.reported == 9
    assert [r.load for r in pool.replicas] == [0, 0, 0]  # none of them this client's
    home.client.page = 'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
    assert _request(pool, _tokens(second, 64)) is not home    # read under a second ago
    monkeypatch.setattr(pool_module, "LOAD_EVERY", 0.0)
    assert _request(pool, _tokens(third, 64)) is home and home.reported == 0


def test_a_pool_hands_out_the_next_replica_after_each_failure_then_raises():
    pool = _pool()
    tokens = _tokens(5, 64)
    attempts = pool.attempts(tokens)
    tried = []
    with pytest.raises(ss.EngineError, match="no replica of the pool") as raised:
        for replica in attempts:
            tried.append(replica)
            assert replica.load == 1 and sum(r.load for r in pool.replicas) == 1
            replica.client.up = False
            pool.failed(replica, ServerDown("connection refused"))
    assert len(set(map(id, tried))) == 3 and "connection refused" in str(raised.value)
    assert [r.health for r in pool.info()] == ["down"] * 3 and all(
        r.load == 0 for r in pool.replicas)
    pool.replicas[1].client.up = True               # back: the next request probes and finds it
    attempts = pool.attempts(tokens)
    assert next(attempts) is pool.replicas[1]
    attempts.close()
    assert [r.health for r in pool.info()] == ["down", "up", "down"]


def test_a_5xx_from_a_replica_whose_health_answers_leaves_it_up_and_one_silent_is_down():
    pool = _pool(2)
    attempts = pool.attempts(_tokens(6, 64))
    replica = next(attempts)
    error = ServerDown("refused the request (500): bad input", answered=True)
    assert pool.failed(replica, error)                  # up: the request's, or a router's
    attempts.close()
    assert [r.health for r in pool.info()] == ["up", "up"]
    replica.client.up = False                        # the same answer, /health silent: down
    assert not pool.failed(replica, error)
    assert sorted(r.health for r in pool.info()) == ["down", "up"]


def test_a_down_replica_is_probed_when_due_and_rejoins_while_another_serves():
    now = [0.0]
    pool = _pool(2, clock=lambda: now[0])
    down, other = pool.replicas
    down.client.up = False
    pool.failed(down, ServerDown("connection refused"))   # as a replica down at start-up
    tokens = _tokens(8, 64)
    assert _request(pool, tokens) is other and down.client.probes == 0   # not due yet
    now[0] = PROBE_AFTER[0]
    assert _request(pool, tokens) is other and down.client.probes == 1   # due: probed, silent
    now[0] += PROBE_AFTER[0]
    assert _request(pool, tokens) is other and down.client.probes == 1   # its wait doubled
    down.client.up = True
    now[0] = 10 * PROBE_AFTER[1]
    _request(pool, tokens)
    assert down.client.probes == 2 and down.health.up    # answered: it rejoined


def test_a_due_probe_is_made_by_one_request_while_the_others_go_on():
    now = [0.0]
    pool = _pool(2, clock=lambda: now[0])
    down, other = pool.replicas
    pool.failed(down, ServerDown("connection refused"))
    now[0] = PROBE_AFTER[0]
    meanwhile: list[Replica] = []
    down.client.during = lambda: meanwhile.append(_request(pool, _tokens(9, 64)))
    _request(pool, _tokens(10, 64))
    assert meanwhile == [other] and down.client.probes == 1 and down.health.up


def test_a_server_that_fails_takes_every_rank_behind_its_url_down_and_one_probe_brings_them_back():
    now = [0.0]
    server, spare = _Client("http://10.0.0.1:8000"), _Client("http://10.0.0.2:8000")
    ranks = [Replica(server, rank, clock=lambda: now[0]) for rank in range(3)]
    pool = Pool([*ranks, Replica(spare, clock=lambda: now[0])], block=16)
    server.up = False
    pool.failed(ranks[1], ServerDown("connection reset"))
    assert [r.health.up for r in pool.replicas] == [False, False, False, True]
    assert all(_request(pool, _tokens(s, 64)) is pool.replicas[3] for s in range(10))
    server.up = True
    now[0] = PROBE_AFTER[0]
    _request(pool, _tokens(11, 64))
    assert server.probes == 1 and all(r.health.up for r in pool.replicas)


def test_the_requests_in_flight_on_a_server_that_fails_count_as_one_failure():
    now = [0.0]
    pool = _pool(2, clock=lambda: now[0])
    tokens = _tokens(12, 64)
    flights = [pool.attempts(tokens) for _ in range(4)]
    replicas = [next(f) for f in flights]
    home = replicas[0]
    assert all(r is home for r in replicas) and home.load == 4
    home.client.up = False
    for replica in replicas:
        pool.failed(replica, ServerDown("connection reset"))
    assert home.health.failures == 1 and home.health.retry_at == PROBE_AFTER[0]
    for flight in flights:
        flight.close()


class _Streaming(http.server.BaseHTTPRequestHandler):
    """Streams three tokens as vLLM does, then ``data: [DONE]``; while the server's ``cuts``
    (shared by the stand-ins of a test) last, a request loses its last token and ``[DONE]``
    instead, the connection closed cleanly (as by a proxy that gives up).  While its
    ``statuses`` last, a request is answered with the next of them instead (an error).  Each
    request's headers go in its ``seen``."""

    def log_message(self, *args):
        pass

    def do_GET(self):                                # /health
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.seen.append(dict(self.headers))
            status = self.server.statuses.pop(0) if self.server.statuses else 200
        if status != 200:
            payload = json.dumps({"error": {"message": f"status {status}"}}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        with self.server.lock:
            cut = self.server.cuts[0] > 0
            self.server.cuts[0] -= cut
        for k, token in enumerate((504, 3458, 11)[:2 if cut else 3]):
            event = {"choices": [{"index": 0, "token_ids": [token],
                                  "finish_reason": "length" if k == 2 else None,
                                  "logprobs": {"token_logprobs": [-1.0],
                                               "top_logprobs": [{f"token_id:{token}": -1.0}]}}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        if not cut:
            self.wfile.write(b"data: [DONE]\n\n")


@contextlib.contextmanager
def _stand_ins(n: int):
    """``n`` stand-in servers on loopback ports of their own, and their shared ``cuts``
    (a one-item list: how many of the next requests to any of them are cut)."""
    cuts, lock = [0], threading.Lock()
    servers = []
    try:
        for _ in range(n):
            httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Streaming)
            httpd.cuts, httpd.lock, httpd.seen, httpd.statuses = cuts, lock, [], []
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
            servers.append(httpd)
        _stand_ins.servers = servers
        yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers], cuts
    finally:
        for httpd in servers:
            httpd.shutdown()
            httpd.server_close()


def test_a_stream_closed_before_done_is_a_server_failure_and_is_sent_again():
    with _stand_ins(2) as (urls, cuts):
        client = Client(urls[0])
        try:
            cuts[0] = 1
            with pytest.raises(ServerDown, match=r"\[DONE\]"):
                list(client.stream("/v1/completions", {"prompt": [1]}))
            assert len(list(client.stream("/v1/completions", {"prompt": [1]}))) == 3
        finally:
            client.close()
        pool = Pool([Replica(Client(url)) for url in urls], block=16)
        backend = VllmBackend(pool, "m", 50_000, "0" * 64, 512)
        try:
            cuts[0] = 1                    # the replica the request goes to first cuts it
            got = list(backend.complete(Completion([1, 2, 3], 3, ss.greedy())))
        finally:
            backend.close()
    assert [t.token for t in got] == [504, 3458, 11]
    assert got[-1].finish is FinishReason.MAX_TOKENS
    assert sorted(r.health.up for r in pool.replicas) == [False, True]


def _backend(urls: list[str], **pool) -> VllmBackend:
    return VllmBackend(Pool([Replica(Client(url)) for url in urls], block=16, **pool),
                       "m", 50_000, "0" * 64, 512)


def _complete(backend: VllmBackend, tokens: list[int]) -> list[int | None]:
    return [t.token for t in backend.complete(Completion(tokens, 3, ss.greedy()))]


def test_one_url_sends_a_cut_stream_again_and_streams_no_token_twice():
    with _stand_ins(1) as (urls, cuts):
        server = _stand_ins.servers[0]
        backend = _backend(urls, waits=(0.05, 0.1))
        try:
            cuts[0] = 2                      # cut twice: the URL is a router whose server died
            assert _complete(backend, [1, 2, 3]) == [504, 3458, 11]
            assert len(server.seen) == 3                    # sent again, twice
            assert [r.health for r in backend.pool.info()] == ["up"]
            cuts[0] = 3                      # more cuts than rounds: the call fails
            with pytest.raises(ss.EngineError, match=r"\[DONE\]"):
                _complete(backend, [1, 2, 3])
        finally:
            backend.close()


def test_one_url_that_stays_down_fails_after_bounded_retries_with_back_off():
    backend = _backend([f"http://127.0.0.1:{free_port()}"], waits=(0.2, 0.4))
    try:
        start = time.monotonic()
        with pytest.raises(ss.EngineError, match="did not answer"):
            _complete(backend, [1, 2, 3])
        assert 0.6 <= time.monotonic() - start < 5        # both waits, then the error
    finally:
        backend.close()


def test_a_5xx_is_sent_again_and_a_4xx_is_raised_at_once():
    with _stand_ins(1) as (urls, cuts):
        server = _stand_ins.servers[0]
        backend = _backend(urls, waits=(0.05,))
        try:
            server.statuses[:] = [500]   # vllm-router's answer for a server behind it gone
            assert _complete(backend, [1, 2, 3]) == [504, 3458, 11]
            assert len(server.seen) == 2
            server.statuses[:] = [400, 400]
            with pytest.raises(ss.ArgumentError, match="400"):
                _complete(backend, [1, 2, 3])
            assert len(server.seen) == 3                    # not sent again
            server.statuses[:] = [500, 503]          # every round: that answer is raised
            with pytest.raises(ss.EngineError, match="503"):
                _complete(backend, [1, 2, 3])
            assert len(server.seen) == 5
            assert [r.health for r in backend.pool.info()] == ["up"]
        finally:
            backend.close()


def test_a_lineage_keeps_one_key_and_unrelated_roots_get_their_own():
    sessions = Sessions(block=16, spill=4)

    def served(tokens: list[int], generated: list[int] = ()) -> str:
        key = sessions.begin(tokens)
        sessions.record(tokens + list(generated), key, generated_from=len(tokens))
        sessions.end(key)
        return key

    root = _tokens(1, 200)
    key = served(root)
    generated = root + _tokens(2, 40)
    assert served(generated) == key                                  # its continuation
    assert {sessions.key(root) for _ in range(4)} == {key}            # forks, samples
    assert sessions.key(generated[:230] + [7]) == key                 # a beam's row
    assert sessions.key(root[:150] + _tokens(3, 20)) == key           # a score of a slice
    turn = generated + _tokens(4, 60)
    assert served(turn) == key and served(turn + _tokens(5, 90)) == key   # chat turns
    other = _tokens(6, 200)
    assert served(other) != key and Sessions(16).key(other) == sessions.key(other)
    assert Sessions(16).key(root) == key                   # every client keys a root alike
    # a root sharing a short head is a new root; one that mostly extends a document is not
    assert sessions.key(root[:16] + _tokens(7, 200)) != key
    assert sessions.key(root + _tokens(8, 100)) == key


def test_a_shared_prefix_with_more_than_spill_in_flight_gives_new_roots_keys_of_their_own():
    sessions = Sessions(block=16, spill=2)
    system = _tokens(9, 200)
    shared = sessions.begin(system)
    sessions.record(system, shared)
    sessions.end(shared)
    chats = [system + _tokens(10 + i, 30) for i in range(6)]
    keys = [sessions.begin(chat) for chat in chats]        # all in flight at once
    assert keys[:3] == [shared] * 3                          # up to spill beyond: shared
    assert len(set(keys[3:])) == 3 and shared not in keys[3:]
    # so do chats whose own tokens end inside the system prompt's last, partial block
    short = [sessions.begin(system + _tokens(20 + i, 5)) for i in range(3)]
    assert len(set(short)) == 3 and shared not in short
    # a request that continues a state (its chain reaches generated tokens) keeps the
    # state's key however busy it is: a continuation, a beam's row, a score
    answer = system + _tokens(30, 40)
    sessions.record(answer, shared, generated_from=len(system))
    assert sessions.begin(answer + [5, 6]) == shared
    assert sessions.begin(answer[:230] + [7]) == shared


def test_requests_carry_the_lineage_key_in_the_session_header_or_none():
    with _stand_ins(1) as (urls, cuts):
        server = _stand_ins.servers[0]
        backend = _backend(urls)
        quiet = _backend(urls, header=None)
        try:
            root = _tokens(11, 64)
            _complete(backend, root)
            _complete(backend, root + [504, 3458, 11, 9])            # its continuation
            with pytest.raises(ss.EngineError, match="not JSON"):    # it streams every
                backend.top(root + [504], 2)            # answer: a beam's next-token post
            _complete(backend, _tokens(12, 64))                       # an unrelated root
            _complete(quiet, root)
        finally:
            backend.close()
            quiet.close()
    keys = [seen.get(SESSION_HEADER) for seen in server.seen]
    assert keys[0] and keys[:3] == [keys[0]] * 3
    assert keys[3] and keys[3] != keys[0] and keys[4] is None
    with pytest.raises(ss.ArgumentError, match="session_header"):    # before any request
        ss.models.vllm(f"http://127.0.0.1:{free_port()}", session_header="X Session")
