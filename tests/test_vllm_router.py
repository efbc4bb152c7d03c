"""vllm-router in front of servers (`seqstate.vllm.Router`): the real router (``make vllm``
installs it in the server environment) on loopback, in front of stand-in servers that
record each request (`test_vllm_routing`'s), and in front of two vLLM servers in
``test_vllm_pool.py``."""

from __future__ import annotations

import os

import pytest

from seqstate.backends.vllm.pool import SESSION_HEADER
from seqstate.errors import ArgumentError, ModelNotAvailable
from seqstate.backends.vllm.serve import main, parser
from seqstate.vllm import Router

from test_vllm_routing import _backend, _complete, _stand_ins, _tokens


@pytest.fixture(scope="module")
def router_ready():
    """Skipped where the server environment or its vllm-router is missing, unless
    SEQSTATE_REQUIRE_VLLM is set."""
    try:
        Router(["http://127.0.0.1:1"])
    except ModelNotAvailable as exc:
        if os.environ.get("SEQSTATE_REQUIRE_VLLM"):
            raise
        pytest.skip(f"no vllm-router: {exc}")


def _servers_of(stand_ins) -> dict[str, set[int]]:
    """Each session key the stand-ins saw, and which of them saw it."""
    where: dict[str, set[int]] = {}
    for i, httpd in enumerate(stand_ins):
        for seen in httpd.seen:
            key = {k.lower(): v for k, v in seen.items()}[SESSION_HEADER.lower()]
            where.setdefault(key, set()).add(i)
    return where


def test_consistent_hash_keeps_each_lineage_on_one_server_and_a_dead_one_loses_none(
        router_ready):
    with _stand_ins(2) as (urls, cuts), Router(urls, "consistent_hash") as router:
        stand_ins = _stand_ins.servers
        backend = _backend([router.url])
        try:
            roots = [_tokens(s, 64) for s in range(16)]
            for root in roots:
                _complete(backend, root)
                _complete(backend, root + [504, 3458, 11, 7])     # its continuation
            where = _servers_of(stand_ins)
            assert len(where) == 16 and all(len(s) == 1 for s in where.values())
            assert set().union(*where.values()) == {0, 1}          # lineages spread
            stand_ins[0].shutdown()                 # a server dies: the router answers 500
            stand_ins[0].server_close()             # for its keys until it moves them
            before = len(stand_ins[1].seen)
            for root in roots:
                assert _complete(backend, root + [504, 3458, 11, 8]) == [504, 3458, 11]
            assert len(stand_ins[1].seen) - before == 16           # every one, served once
        finally:
            backend.close()


def test_a_router_is_refused_bad_urls_and_policies_before_it_starts(router_ready):
    with pytest.raises(ArgumentError, match="policy"):
        Router(["http://127.0.0.1:1"], "nearest")
    with pytest.raises(ArgumentError, match="URLs"):
        Router(["127.0.0.1:1"])
    command = Router(["http://127.0.0.1:1"], "cache_aware", retry_max_retries=2,
                     disable_circuit_breaker=True).command()
    assert command[command.index("--policy") + 1] == "cache_aware"
    assert command[command.index("--retry-max-retries") + 1] == "2"
    assert "--disable-circuit-breaker" in command and "--prometheus-port" in command


def test_the_command_line_starts_a_router_and_reports_a_bad_one(router_ready, capsys):
    args = parser().parse_args(["router", "http://a:1", "http://b:1", "--policy",
                                "cache_aware", "--port", "9000"])
    assert (args.urls, args.policy, args.port) == (["http://a:1", "http://b:1"],
                                                   "cache_aware", 9000)
    assert main(["router", "a:1"]) == 2 and "URLs" in capsys.readouterr().err
