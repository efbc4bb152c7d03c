"""The pool's routing rules and health states, without servers (`seqstate.backends.vllm.routing`,
`seqstate.backends.vllm.pool.Health`)."""

from __future__ import annotations

import random

import pytest

import seqstate as ss
from seqstate.backends.vllm import metrics
from seqstate.backends.vllm.client import ServerDown
from seqstate.backends.vllm.pool import PROBE_AFTER, Health, Pool, Replica
from seqstate.backends.vllm.routing import Lineage, Router, block_hashes, rendezvous

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
        router.record(generated, home)
        assert router.route(root, IDLE) == home                      # a fork (same prompt)
        assert router.route(generated + [5, 6, 7], IDLE) == home     # its continuation
        assert router.route(root[:180] + [9] * 5, IDLE) == home      # a slice, then a score
        # even where the home is busier than the rest: a lineage does not spill
        busy = {r: (50 if r == home else 0) for r in IDLE}
        assert router.route(generated + [1], busy) == home


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
    """A stand-in for `Client` where only its ``/health`` matters (`Pool` asks no more)."""

    def __init__(self, url: str, alive: bool = True) -> None:
        self.url, self.up = url, alive

    def alive(self) -> bool:
        return self.up

    def close(self) -> None:
        pass


def _pool(n: int = 3) -> Pool:
    return Pool([Replica(_Client(f"http://10.0.0.{i}:8000")) for i in range(n)], block=16)


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


def test_a_5xx_from_a_replica_whose_health_answers_is_the_requests_own_error():
    pool = _pool(2)
    attempts = pool.attempts(_tokens(6, 64))
    replica = next(attempts)
    error = ServerDown("refused the request (500): bad input", answered=True)
    with pytest.raises(ServerDown, match="bad input"):
        pool.failed(replica, error)
    attempts.close()
    assert [r.health for r in pool.info()] == ["up", "up"]
    replica.client.up = False                        # the same answer, /health silent: down
    pool.failed(replica, error)
    assert sorted(r.health for r in pool.info()) == ["down", "up"]
