"""A pool of vLLM replicas (``ss.models.vllm([...])``) against a round-robin spread and one
server: prefix-cache hit rates and times, then a replica killed mid-run.

Three fp32 CPU servers with small KV caches (`KV_GIB` each: a few of the long prefixes fit
on one server at once, all of them fit on the three) run `PROGRAMS` programs over `PREFIXES`
long shared prefixes, `CONCURRENT` at a time.  Each program: a text call after its prefix
and question, a continuation, a fork (two seeded samples) and a choice.  Every mode runs the
same programs, each server's prefix cache emptied first (vLLM's ``/reset_prefix_cache``,
served in its dev mode); hit rates are the servers' own ``/metrics`` counters
(``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``, in tokens):

- ``one server``: every request to the first server;
- ``round robin``: each request to the next server in turn (an L7 balancer without
  affinity);
- ``pool``: seqstate's routing by lineage;
- ``pool, one killed``: the pool again, the server with the most requests in flight killed
  (SIGKILL) once a third of the programs are done; every program must finish with the
  one-server run's tokens.  The killed server's counters die with it: the hit rate is the
  survivors'.
- ``router consistent_hash`` / ``router cache_aware``: one URL, vllm-router (`Router`) in
  front of the servers with that policy; seqstate sends each request's lineage key in the
  ``X-Session-ID`` header, which ``consistent_hash`` hashes first;
- ``router, one killed``: through the ``consistent_hash`` router, the server with the most
  requests running (by its ``/metrics``) killed once a third of the programs are done.

Then `CHATS` unrelated chats behind one system prompt of ~`SYSTEM_TOKENS` tokens, through
the ``consistent_hash`` router: how their requests spread over the servers (a key made from
the shared prompt alone would send them all to one).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import urllib3

import seqstate as ss
from seqstate.backends.vllm import metrics, routing
from seqstate.vllm import Router, Server

PREFIXES = 6
PER_PREFIX = 6
PROGRAMS = PREFIXES * PER_PREFIX
CONCURRENT = 12
PREFIX_TOKENS = 400
KV_GIB = 0.06
MAX_MODEL_LEN = 1024
SERVERS = 3
START_SECONDS = 1800.0   # three servers starting at once on a busy CPU
WORDS = ("river stone lantern orchard copper meadow harbor thistle quarry ember willow "
         "falcon glacier saddle velvet marble cinder hollow pewter tundra").split()
OPTIONS = [" yes", " no", " unsure"]
CHATS = 36
SYSTEM_TOKENS = 200


class RoundRobin(routing.Router):
    """Each request to the next replica in turn, whatever its tokens (no affinity)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._next = 0
        self._turn = threading.Lock()

    def route(self, tokens, loads) -> int:
        with self._turn:
            order = sorted(loads)
            self._next += 1
            return order[self._next % len(order)]


def prefixes(model) -> list[list[int]]:
    """`PREFIXES` distinct documents of `PREFIX_TOKENS` tokens each (seeded)."""
    out = []
    for i in range(PREFIXES):
        rng = random.Random(i)
        text = f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(PREFIX_TOKENS))
        out.append(model.encode(text)[:PREFIX_TOKENS])
    return out


def program(model, prefix: list[int], k: int):
    """One program: a text call, a continuation, a fork and a choice; its final tokens."""
    gen = ss.text(model)
    s = ss.from_tokens(model, [prefix]) + f"\nQuestion {k}: what comes next?\nAnswer:"
    s = gen(s, max_tokens=12)
    s = gen(s + " Because", max_tokens=8)
    forks = gen(s + " Also", num_samples=2, max_tokens=6, sampler=ss.multinomial(), seed=k)
    choice = ss.choice(model, OPTIONS)(s + "\nIs that right?")
    return (s.token_ids, forks.token_ids, choice.value)


def run(model, docs, kill=None) -> tuple[float, list]:
    """Every program, `CONCURRENT` at a time: seconds and results in program order.
    ``kill()`` is called once a third of them are done."""
    done = [0]
    lock = threading.Lock()

    def one(i: int):
        out = program(model, docs[i % PREFIXES], i // PREFIXES)
        with lock:
            done[0] += 1
            if kill is not None and done[0] == PROGRAMS // 3:
                kill()
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        results = list(pool.map(one, range(PROGRAMS)))
    return time.perf_counter() - t0, results


def counters(http, urls) -> list[tuple[float, float, float] | None]:
    """Each server's (prefix-cache queries, hits, requests finished), from its /metrics
    (None if it is gone)."""
    out = []
    for url in urls:
        try:
            samples = metrics.parse(http.request("GET", url + "/metrics").data.decode())
        except urllib3.exceptions.HTTPError:
            out.append(None)
            continue
        out.append((metrics.total(samples, "vllm:prefix_cache_queries"),
                    metrics.total(samples, "vllm:prefix_cache_hits"),
                    metrics.total(samples, "vllm:request_success")))
    return out


def measured(name, model, urls, http, docs, kill=None):
    for url in urls:
        http.request("POST", url + "/reset_prefix_cache")
    before = counters(http, urls)
    seconds, results = run(model, docs, kill)
    after = counters(http, urls)
    # a killed server's counters are gone with it: its share is left out
    per = [tuple(x - y for x, y in zip(a, b)) if a else None for a, b in zip(after, before)]
    queries = sum(p[0] for p in per if p)
    hits = sum(p[1] for p in per if p)
    spread = " ".join("killed" if p is None else f"{p[1] / p[0]:.2f}" if p[0] else "-"
                      for p in per)
    served = " ".join("killed" if p is None else f"{p[2]:.0f}" for p in per)
    print(f"  {name:<24} {seconds:7.1f} s   hit rate {hits / max(1, queries):.3f}   "
          f"({hits:.0f} of {queries:.0f} prompt tokens; per server {spread}; "
          f"requests per server {served})")
    return results


def running(http, url) -> int:
    """Requests running and waiting on the server at ``url`` (-1 if it is gone)."""
    try:
        page = http.request("GET", url + "/metrics").data.decode()
    except urllib3.exceptions.HTTPError:
        return -1
    return sum(metrics.requests(metrics.parse(page)).values())


def chats(model, urls, http) -> None:
    """`CHATS` unrelated chats behind one system prompt: their requests per server."""
    rng = random.Random(99)
    system = "You are the harbour board's assistant. " + " ".join(
        rng.choice(WORDS) for _ in range(SYSTEM_TOKENS - 10))
    before = counters(http, urls)

    def chat(k: int):
        s = ss.chat(model).system(system).user(f"Question {k}: name a {WORDS[k % 20]}.")
        s = s.assistant(ss.text(model), max_tokens=24)
        s.user("And another?").assistant(ss.text(model), max_tokens=24)

    with ThreadPoolExecutor(CONCURRENT) as pool:
        list(pool.map(chat, range(CHATS)))
    after = counters(http, urls)
    per = [a[2] - b[2] for a, b in zip(after, before)]
    print(f"  {CHATS} chats behind one {SYSTEM_TOKENS}-token system prompt, through the "
          f"router: requests per server {[int(p) for p in per]}, the most "
          f"{max(per) / max(1, sum(per)):.0%} of them")


def main(model=None) -> None:
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"          # /reset_prefix_cache between modes
    servers = [Server(kv_cache_gib=KV_GIB, max_model_len=MAX_MODEL_LEN,
                      log=open(f"/tmp/seqstate-bench-pool-{i}.log", "w")) for i in range(SERVERS)]
    try:
        with ThreadPoolExecutor(SERVERS) as starting:         # started side by side
            list(starting.map(lambda s: s.start(START_SECONDS), servers))
        urls = [s.url for s in servers]
        http = urllib3.PoolManager(maxsize=8)
        one = ss.models.vllm(urls[0])
        docs = prefixes(one)
        print(f"\n== {PROGRAMS} programs over {PREFIXES} prefixes of {PREFIX_TOKENS} tokens, "
              f"{CONCURRENT} at a time; {SERVERS} CPU servers, KV cache {KV_GIB} GiB each")
        reference = measured("one server", one, urls[:1], http, docs)
        spread = ss.models.vllm(urls)
        spread.backend.pool.router = RoundRobin(spread.backend.pool.router.block)
        robin = measured("round robin", spread, urls, http, docs)
        pool = ss.models.vllm(urls)
        ours = measured("pool", pool, urls, http, docs)
        survivors = ss.models.vllm(urls)

        def kill():                        # the replica with the most requests in flight
            busiest = max(range(SERVERS), key=lambda i: survivors.replicas[i].load)
            print(f"  (killing {urls[busiest]} with "
                  f"{survivors.replicas[busiest].load} requests in flight)")
            os.killpg(servers[busiest].process.pid, signal.SIGKILL)

        failover = measured("pool, one killed", survivors, urls, http, docs, kill)
        for server in servers:
            if server.process is None or server.process.poll() is not None:
                server.stop()
                server.start(START_SECONDS)                 # the killed one, back
        routed = {}
        for policy in ("consistent_hash", "cache_aware"):
            with Router(urls, policy, log=open(f"/tmp/seqstate-bench-router-{policy}.log",
                                               "w")) as router:
                through = ss.models.vllm(router.url)
                routed[policy] = measured(f"router {policy}", through, urls, http, docs)
                through.close()
        with Router(urls, "consistent_hash",
                    log=open("/tmp/seqstate-bench-router-killed.log", "w")) as router:
            through = ss.models.vllm(router.url)

            def kill_behind():              # the server with the most requests running
                busiest = max(range(SERVERS), key=lambda i: running(http, urls[i]))
                print(f"  (killing {urls[busiest]} behind the router, "
                      f"{running(http, urls[busiest])} requests running)")
                os.killpg(servers[busiest].process.pid, signal.SIGKILL)

            routed["killed"] = measured("router, one killed", through, urls, http, docs,
                                        kill_behind)
            through.close()
        for server in servers:
            if server.process is None or server.process.poll() is not None:
                server.stop()
                server.start(START_SECONDS)
        with Router(urls, "consistent_hash") as router:
            through = ss.models.vllm(router.url)
            chats(through, urls, http)
            through.close()
        for name, got in (("round robin", robin), ("pool", ours),
                          ("pool, one killed", failover),
                          ("router consistent_hash", routed["consistent_hash"]),
                          ("router cache_aware", routed["cache_aware"]),
                          ("router, one killed", routed["killed"])):
            same = sum(g == r for g, r in zip(got, reference))
            print(f"  {name}: {same}/{PROGRAMS} programs identical to the one-server run")
        states = [(r.url, r.health, r.served) for r in survivors.replicas]
        print(f"  replicas after the kill (url, health, requests served): {states}")
    finally:
        for server in servers:
            server.stop()
