"""A pool of vLLM replicas serving the same weights, used as one server.

A replica is a server URL, or one data-parallel rank behind a URL (requests carry vLLM's
``X-data-parallel-rank`` header); one URL (a server, or a router in front of several) is a
pool of one.  `Pool.call` sends a request: to the replica `Router` picks, then, each time
one fails as a server (`ServerDown`), to the next (`Pool.attempts`).  A replica that failed
is down (`Health`), with every other rank behind its URL: requests skip it until its next
probe of ``/health`` is due.  The first request to find the probe due makes it before
choosing (waiting at most the probe's timeout, `client.PROBE_TIMEOUT`), and the replica
rejoins when it answers.  When every replica has been tried, the request waits (`RETRY_WAITS`,
doubling), probes each again and goes on with those that answer, a few times; then the call
raises `EngineError`.  A 5xx from a replica whose ``/health`` answers leaves it up, and the
request is sent again like the others (a router answers 500 for a server behind it that
died, vllm-router 0.1.17 among them); where every round ends so, that answer is raised.  A
4xx is the request's own error, never sent again.

Each request carries a lineage key (`Sessions`, in the header ``Pool.header``): what a
router in front of replicas hashes to keep a state's lineage on one of them.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing
from typing import TypeVar

from seqstate.backends.vllm import metrics
from seqstate.backends.vllm.client import Client, ServerDown
from seqstate.backends.vllm.routing import Router, Sessions
from seqstate.errors import EngineError

__all__ = ["Pool", "Replica", "ReplicaInfo", "Health", "RANK_HEADER", "SESSION_HEADER",
           "PROBE_AFTER", "RETRY_WAITS"]

T = TypeVar("T")
R = TypeVar("R")

RANK_HEADER = "X-data-parallel-rank"   # vLLM's header pinning a request to one DP engine
SESSION_HEADER = "X-Session-ID"        # vllm-router's first key for consistent_hash
PROBE_AFTER = (1.0, 30.0)   # seconds before a down replica is probed: the first wait,
                            # doubling with each failed probe up to the last
LOAD_EVERY = 1.0            # seconds between readings of the servers' own loads (/metrics)
RETRY_WAITS = (0.25, 0.5, 1.0, 2.0)  # seconds a request waits, once every replica has failed
                                     # it, before each new round of tries


class Health:
    """A replica's health: up, or down until ``retry_at`` (then due a probe).

    Each failure in a row doubles the wait before the next probe (`PROBE_AFTER`); a success
    makes it up again.  ``clock`` is injectable for tests.

    Examples
    --------
    >>> now = [0.0]
    >>> h = Health(clock=lambda: now[0])
    >>> h.fail("refused"); (h.up, h.due())
    (False, False)
    >>> now[0] = 1.0; h.due()
    True
    >>> h.fail("refused"); h.retry_at     # a second failure: twice as long
    3.0
    >>> now[0] = 3.0; (h.claim(), h.claim())   # one caller takes it
    (True, False)
    >>> h.succeed(); h.up
    True
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.up = True
        self.failures = 0
        self.retry_at = 0.0
        self.reason = ""
        self.seen_at: float | None = None   # when an answer (or a failure) last said it

    def fail(self, reason: str) -> None:
        self.seen_at = self.clock()
        self.up = False
        self.failures += 1
        self.reason = reason
        wait = min(PROBE_AFTER[0] * 2 ** (self.failures - 1), PROBE_AFTER[1])
        self.retry_at = self.clock() + wait

    def succeed(self) -> None:
        self.up, self.failures, self.reason = True, 0, ""
        self.seen_at = self.clock()

    def age(self) -> float | None:
        """Seconds since the health was last seen (None: never, since the pool was made)."""
        return None if self.seen_at is None else self.clock() - self.seen_at

    def due(self) -> bool:
        """Whether a down replica's next probe is due."""
        return not self.up and self.clock() >= self.retry_at

    def claim(self) -> bool:
        """Whether a down replica's next probe is due, taking it if so: until the probe's
        answer (`succeed` or `fail`), or the longest wait, it is not due to anyone else."""
        if not self.due():
            return False
        self.retry_at = self.clock() + PROBE_AFTER[1]
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What ``model.replicas`` reports of one replica: its ``url``, its data-parallel
    ``rank`` (None: the server's own balancing), ``health`` (``"up"`` or ``"down"``),
    ``load`` (this client's requests in flight there), ``served`` (requests it answered),
    when down ``reason`` (the failure that put it down), and ``seen``: seconds since its
    health was last seen, by an answer, a failure or a probe (None: never).  A replica that
    died while no request of this client reached it still reads ``"up"``: ``seen`` says how
    old that reading is."""

    url: str
    rank: int | None
    health: str
    load: int
    served: int
    reason: str = ""
    seen: float | None = None


class Replica:
    """One place to send requests: a client, and the data-parallel rank to pin (or None)."""

    def __init__(self, client: Client, rank: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.rank = rank
        self.headers = {} if rank is None else {RANK_HEADER: str(rank)}
        self.health = Health(clock)
        self.load = 0
        self.served = 0
        self.reported = 0          # requests running and waiting there, by its /metrics

    @property
    def busy(self) -> int:
        """Its load for routing: the server's own count (every client's requests, as last
        read) or this client's requests in flight, whichever is more."""
        return max(self.load, self.reported)

    @property
    def name(self) -> str:
        return self.client.url if self.rank is None else f"{self.client.url}#{self.rank}"

    def stream(self, path: str, body: dict, headers: dict[str, str] | None = None
               ) -> Iterator[dict]:
        return self.client.stream(path, body, headers={**self.headers, **(headers or {})})

    def post(self, path: str, body: dict, headers: dict[str, str] | None = None) -> dict:
        return self.client.post(path, body, headers={**self.headers, **(headers or {})})

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.client.url, self.rank, "up" if self.health.up else "down",
                           self.load, self.served, self.health.reason, self.health.age())


class Pool:
    """Replicas of one model, routed by lineage (`Router`), failing over (see the module).

    Parameters
    ----------
    replicas : sequence of Replica
        Servers (or ranks) of the same weights.
    block : int
        The servers' KV block size, for the router.
    spill : int
        The router's spill threshold (`Router`), and the lineage keys' (`Sessions`).
    header : str or None
        The header each request's lineage key goes in (None: none is sent).
    waits : sequence of float
        Seconds before each new round of tries once every replica has failed a request.
    """

    def __init__(self, replicas: Sequence[Replica], block: int, spill: int | None = None,
                 header: str | None = SESSION_HEADER,
                 waits: Sequence[float] = RETRY_WAITS) -> None:
        if not replicas:
            raise EngineError("a pool needs at least one replica")
        self.replicas = list(replicas)
        names = {i: r.name for i, r in enumerate(self.replicas)}
        limits = {} if spill is None else {"spill": spill}
        self.router = Router(block, names=names, **limits)
        self.sessions = Sessions(block, **limits)
        self.header = header
        self.waits = tuple(waits)
        self._lock = threading.Lock()
        self._loads_read_at = -math.inf

    @property
    def client(self) -> Client:
        """The first replica's client (a single server's, where the pool has one)."""
        return self.replicas[0].client

    def call(self, tokens: Sequence[int],
             request: Callable[[Replica, dict[str, str]],
                               Generator[T, None, tuple[R, list[list[int]]]]]
             ) -> Generator[T, None, R]:
        """Send a request of ``tokens`` until a replica serves it: ``request(replica,
        headers)`` sends it (with ``headers``: the lineage key's) and returns ``(value,
        rows)``, the rows of tokens (prompt and generated) it left on the replica; what it
        yields is yielded.  Where it fails as a server (`ServerDown`) it is called again with
        the next of `attempts`.  Returns ``value``; `EngineError` where none can serve (the
        last answer, where a replica that answers ``/health`` failed the last try)."""
        key = None if self.header is None else self.sessions.begin(tokens)
        headers = {} if key is None else {self.header: key}
        answered: ServerDown | None = None
        try:
            with closing(self.attempts(tokens)) as attempts:
                for replica in attempts:
                    try:
                        value, rows = yield from request(replica, headers)
                    except ServerDown as exc:
                        answered = exc if self.failed(replica, exc) else None
                        continue
                    for row in rows:
                        self.served(replica, row, generated_from=len(tokens))
                        if key is not None:
                            self.sessions.record(row, key, generated_from=len(tokens))
                    return value
        except EngineError:
            if answered is None:
                raise
            raise answered from None
        finally:
            if key is not None:
                self.sessions.end(key)
        raise AssertionError("unreachable: attempts raises when none is left")

    def post(self, tokens: Sequence[int], path: str, body: dict) -> dict:
        """`call` for a request of ``tokens`` answered at once: its JSON answer."""
        def send(replica: Replica, headers: dict[str, str]):
            return replica.post(path, body, headers), [list(tokens)]
            yield                                      # a generator that streams nothing

        calling = self.call(tokens, send)
        try:
            next(calling)
        except StopIteration as done:
            return done.value
        raise AssertionError("unreachable: a post streams nothing")

    def attempts(self, tokens: Sequence[int]) -> Iterator[Replica]:
        """The replicas to try for a request of ``tokens``, one at a time: the caller takes
        the next only after calling `failed` on the last (`call` does both).  Before each
        choice, the down replicas whose probe is due are probed.  Once every replica has
        been tried, it waits (`waits`), probes each down one and tries again those up, as
        many rounds as ``waits`` has.  Each is counted in flight until the caller takes the
        next or closes the iterator.  `EngineError` where none is left that can serve."""
        tried: set[int] = set()
        errors: list[str] = []
        waits = iter(self.waits)
        with self._lock:
            everyone = not any(r.health.up for r in self.replicas)
        while True:
            self._probe(tried, everyone)
            everyone = False
            if len(self.replicas) > 1:
                self._read_loads()
            with self._lock:
                loads = {i: r.busy for i, r in enumerate(self.replicas)
                         if r.health.up and i not in tried}
                if loads:
                    index = next(iter(loads))
                    if len(self.replicas) > 1:            # one server: nothing to choose
                        index = self.router.route(tokens, loads)
                        self.router.record(tokens, index)
                    replica = self.replicas[index]
                    replica.load += 1
            if not loads:
                wait = next(waits, None)
                if wait is None:
                    raise EngineError(self._none_left(errors))
                time.sleep(wait)                      # a new round: every replica again
                tried.clear()
                everyone = True
                continue
            tried.add(index)
            try:
                yield replica
            finally:
                with self._lock:
                    replica.load -= 1
            errors.append(f"{replica.name}: {replica.health.reason or 'failed'}")

    def _read_loads(self) -> None:
        """Once every `LOAD_EVERY` seconds (one caller reads, the others go on), each up
        server's requests running and waiting, from its ``/metrics``: other clients' load
        counts too.  A server that does not answer keeps its last reading."""
        with self._lock:
            if time.monotonic() - self._loads_read_at < LOAD_EVERY:
                return
            self._loads_read_at = time.monotonic()
            servers = {r.client.url: r.client for r in self.replicas if r.health.up}
        pages = {url: _requests_on(client) for url, client in servers.items()}
        with self._lock:
            for replica in self.replicas:
                page = pages.get(replica.client.url)
                if page is not None:
                    replica.reported = (sum(page.values()) if replica.rank is None else
                                        page.get(str(replica.rank), 0))

    def _probe(self, tried: set[int], everyone: bool) -> None:
        """Probe the down replicas not yet tried: every one when ``everyone``, else those
        whose probe is due and that this caller claims (`Health.claim`), so concurrent
        requests do not probe one server together.  Those that answer rejoin."""
        with self._lock:
            down = [r for i, r in enumerate(self.replicas)
                    if i not in tried and not r.health.up and (everyone or r.health.claim())]
        servers = {r.client.url: r.client for r in down}     # one probe a server, for its ranks
        answers = {url: client.alive() for url, client in servers.items()}
        with self._lock:
            for replica in down:
                if answers[replica.client.url]:
                    replica.health.succeed()
                else:
                    replica.health.fail(replica.health.reason or "no answer to /health")

    def rejoin_due(self) -> None:
        """Probe every down replica whose probe is due; those that answer rejoin."""
        self._probe(set(), everyone=False)

    def failed(self, replica: Replica, error: ServerDown) -> bool:
        """``replica`` failed a request with ``error``.  Whether it stays up: a replica that
        answered 5xx and whose ``/health`` answers failed this request only (it is tried
        again in the next round).  Otherwise its server is down, with every replica behind
        its URL (each data-parallel rank), and the caller goes on to the next of `attempts`.  Only a failure that finds
        a replica up counts: the requests in flight on a server that fails all fail, and
        one outage is one failure to `Health`, not one a request."""
        if error.answered and replica.client.alive():
            return True
        with self._lock:
            for other in self.replicas:
                if other.client.url == replica.client.url and other.health.up:
                    other.health.fail(str(error))
        return False

    def served(self, replica: Replica, tokens: Sequence[int],
               generated_from: int | None = None) -> None:
        """``replica`` answered a request; ``tokens`` (prompt and generated from
        ``generated_from`` on) live there."""
        with self._lock:
            replica.served += 1
            replica.health.succeed()
            if len(self.replicas) > 1:
                self.router.record(tokens, self.replicas.index(replica), generated_from)

    def info(self) -> list[ReplicaInfo]:
        self.rejoin_due()
        with self._lock:
            return [r.info() for r in self.replicas]

    def _none_left(self, errors: list[str]) -> str:
        urls = ", ".join(r.name for r in self.replicas)
        if len(self.replicas) == 1:
            return errors[-1].partition(": ")[2] if errors else f"{urls} is down"
        said = "; ".join(errors) or "every replica is down and none answers /health"
        return (f"no replica of the pool ({urls}) can serve: {said}.  Start the servers again "
                "(`python -m seqstate.vllm serve`); a replica that answers /health rejoins")

    def close(self) -> None:
        for client in {id(r.client): r.client for r in self.replicas}.values():
            client.close()


def _requests_on(client: Client) -> dict[str, int] | None:
    """A server's requests running and waiting per engine (`metrics.requests`); None where
    its ``/metrics`` does not answer."""
    try:
        return metrics.requests(metrics.parse(client.text("/metrics")))
    except EngineError:
        return None
