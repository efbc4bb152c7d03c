"""Where a request goes in a pool of vLLM replicas: by lineage, then by load.

vLLM caches KV by blocks of ``block`` tokens, each named by a hash chained over the blocks
before it, and only whole blocks are shared.  The router names a request's prefix the same
way (`block_hashes`: a digest per whole block, chained) and remembers which replica last
computed each block (`Lineage`, least recently used first out).  A request goes to:

1. **where its prefix lives**: the replica holding its longest remembered chain of blocks,
   when that chain covers at least half its tokens.  A state's continuations, forks, beams,
   scores and resumed constraints share their prefix with it, so they follow it;
2. otherwise, as a **new root**, to the replica holding the part it shares (where it shares
   a block), or to its **home**: the replica that `rendezvous` hashing picks for its first
   block-aligned tokens, the same on every client and stable when a replica leaves (only the
   roots it held move);
3. a new root **spills** to the least-loaded replica where its choice has more than
   ``spill`` requests in flight beyond that one's (a root that extends a remembered prefix
   of prompt tokens too: the chats behind one system prompt); a request whose remembered
   prefix reaches generated tokens continues a state, and moves only past
   ``lineage_spill`` (`LINEAGE_SPILL`, larger: moving it recomputes its prefix there once,
   and a wide fork or beam of a long state should not queue on one replica while the
   others idle).

A router in front of replicas (vllm-router's ``consistent_hash``, SGLang's gateway, Dynamo)
hashes a header instead: `Sessions` gives each request a lineage key by the same rules, for
one URL's requests to carry.

Nothing here sends anything: `Router` and `Sessions` are pure state, so the rules are tested
without servers (``tests/test_vllm_routing.py``).

Examples
--------
>>> router = Router(block=4)
>>> first = router.route(list(range(12)), {0: 0, 1: 0, 2: 0})
>>> router.record(list(range(12)), first)
>>> continuation = list(range(12)) + [7, 7, 7]
>>> router.route(continuation, {0: 0, 1: 0, 2: 0}) == first
True
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Container, Mapping, Sequence

from seqstate.errors import ArgumentError

__all__ = ["Router", "Sessions", "Lineage", "block_hashes", "rendezvous", "BLOCK", "SPILL",
           "LINEAGE_SPILL", "LINEAGE_BLOCKS"]

BLOCK = 16               # vLLM's default block size, where a server does not say its own
SPILL = 4                # in-flight requests a new root's replica may carry beyond the least
LINEAGE_SPILL = 16       # ... and a lineage's replica
LINEAGE_BLOCKS = 1 << 17  # blocks remembered (each a digest and a replica: a few MiB)


def block_hashes(tokens: Sequence[int], block: int) -> list[bytes]:
    """A digest per whole block of ``tokens``, each over the blocks before it (as vLLM
    names its cached blocks): two rows share the first ``k`` digests exactly when they share
    their first ``k * block`` tokens."""
    data = array("q", tokens).tobytes()
    step = 8 * block
    out: list[bytes] = []
    last = b""
    for start in range(0, len(tokens) // block * step, step):
        last = hashlib.blake2b(last + data[start:start + step], digest_size=12).digest()
        out.append(last)
    return out


def rendezvous(key: bytes, candidates: Sequence[int], names: Mapping[int, str]) -> int:
    """The candidate whose name scores highest with ``key`` (highest-random-weight
    hashing): the same on every client, and when a candidate leaves only the keys it held
    move."""
    return max(candidates, key=lambda c: hashlib.blake2b(key + names[c].encode(),
                                                          digest_size=8).digest())


class Lineage:
    """Which replica last computed each block digest, the least recently used forgotten
    first beyond ``capacity`` blocks."""

    def __init__(self, capacity: int = LINEAGE_BLOCKS) -> None:
        self.capacity = capacity
        self._where: OrderedDict[bytes, int] = OrderedDict()

    def record(self, hashes: Sequence[bytes], replica: int) -> None:
        for h in hashes:
            self._where[h] = replica
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def longest(self, hashes: Sequence[bytes],
                serving: Container | None = None) -> tuple[int, int]:
        """``(blocks, replica)``: the longest chain of ``hashes`` remembered on a replica in
        ``serving`` (None: on any), ``(0, -1)`` where none is."""
        best = (0, -1)
        for depth, h in enumerate(hashes, 1):
            replica = self._where.get(h)
            if replica is None:
                break                     # a chain: no later block can be remembered
            if serving is None or replica in serving:
                best = (depth, replica)
        return best

    def __contains__(self, h: bytes) -> bool:
        return h in self._where

    def __len__(self) -> int:
        return len(self._where)


class _Chains:
    """What a router and a key maker both remember of the tokens sent: each block digest's
    value (`Lineage`), and which blocks hold generated tokens (a request whose remembered
    chain reaches one continues a state)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.lineage = Lineage()
        self.generated = Lineage()

    def _remember(self, tokens: Sequence[int], value, generated_from: int | None) -> None:
        hashes = block_hashes(tokens, self.block)
        self.lineage.record(hashes, value)
        if generated_from is not None:
            self.generated.record(hashes[generated_from // self.block:], 1)

    def _continues(self, hashes: Sequence[bytes], depth: int) -> bool:
        """Whether the first ``depth`` blocks of ``hashes`` reach generated tokens."""
        return depth > 0 and hashes[depth - 1] in self.generated


class Router(_Chains):
    """The pool's routing rules (see the module's docstring).

    Parameters
    ----------
    block : int
        The servers' block size (vLLM's ``--block-size``).
    spill : int
        How many more requests in flight than the least-loaded replica a new root's
        replica may carry before the root goes to the least-loaded one instead.
    lineage_spill : int
        The same for a request whose prefix lives on a replica (larger than ``spill``).
    names : mapping of int to str or None
        Each replica's stable name (its URL and rank) for `rendezvous`; None: the indices.
    """

    def __init__(self, block: int = BLOCK, spill: int = SPILL,
                 names: Mapping[int, str] | None = None,
                 lineage_spill: int = LINEAGE_SPILL) -> None:
        super().__init__(block)
        self.spill = spill
        self.lineage_spill = max(lineage_spill, spill)
        self.names = dict(names) if names is not None else None

    def route(self, tokens: Sequence[int], loads: Mapping[int, int]) -> int:
        """The replica among ``loads`` (replica -> requests in flight; those that can serve
        now) that ``tokens`` go to."""
        if not loads:
            raise ArgumentError("route() needs at least one replica that can serve (loads "
                                "maps each replica that can serve to its requests in flight)")
        hashes = block_hashes(tokens, self.block)
        depth, replica = self.lineage.longest(hashes, loads)
        spill = self.spill
        if depth and 2 * depth * self.block >= len(tokens):     # where its prefix lives
            if self._continues(hashes, depth):                # it continues a state
                spill = self.lineage_spill
        elif not depth:
            key = hashes[0] if hashes else array("q", tokens).tobytes()
            names = self.names or {r: str(r) for r in loads}
            replica = rendezvous(key, sorted(loads), names)  # its home
        if loads[replica] - min(loads.values()) > spill:     # uneven past the threshold
            replica = min(sorted(loads), key=lambda r: loads[r])
        return replica

    def record(self, tokens: Sequence[int], replica: int,
               generated_from: int | None = None) -> None:
        """``tokens`` were (or are being) computed on ``replica``: their whole blocks live
        there now; those from ``generated_from`` on were generated (None: none)."""
        self._remember(tokens, replica, generated_from)


class Sessions(_Chains):
    """Each request's lineage key, for a router in front of replicas to hash (the session
    header), by `Router`'s rules, from tokens alone (every client gives the same):

    1. a request whose longest remembered chain of blocks covers at least half its tokens
       takes that chain's key: a state's continuations, forks, samples, beams, scores and
       chat turns, and a new root that mostly extends a prefix sent before (a document that
       many programs share stays on one replica);
    2. otherwise it is a new root, keyed by its own tokens (the digest of its whole blocks);
    3. a new root that extends a remembered chain of prompt tokens with tokens of its own,
       where the chain's key has more than ``spill`` requests in flight, is keyed by all of
       its tokens (a router cannot spill: without this, every chat behind one system prompt
       would share one key).  A request whose chain reaches tokens a server generated
       continues a state (a continuation, a beam, a score, a chat's next turn): it keeps
       the key however busy.

    Examples
    --------
    >>> sessions = Sessions(block=4)
    >>> root = list(range(12))
    >>> key = sessions.begin(root)
    >>> sessions.record(root + [5, 5, 5, 5], key); sessions.end(key)
    >>> sessions.begin(root + [5, 5, 5, 5, 9]) == key      # its continuation
    True
    >>> sessions.begin([7] * 12) == key                       # an unrelated root
    False
    """

    def __init__(self, block: int = BLOCK, spill: int = SPILL) -> None:
        super().__init__(block)
        self.spill = spill
        self.flying: Counter[str] = Counter()
        self._lock = threading.Lock()

    def key(self, tokens: Sequence[int]) -> str:
        """The lineage key of a request of ``tokens`` (as hex)."""
        hashes = block_hashes(tokens, self.block)
        with self._lock:
            depth, key = self.lineage.longest(hashes)
            busy = (depth * self.block < len(tokens) and self.flying[key] > self.spill
                    and not self._continues(hashes, depth))
        if depth and 2 * depth * self.block >= len(tokens) and not busy:
            return key
        if hashes and not busy:
            return hashes[-1].hex()
        return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=12).hexdigest()

    def begin(self, tokens: Sequence[int]) -> str:
        """The key of a request of ``tokens`` that starts now (in flight until `end`)."""
        key = self.key(tokens)
        with self._lock:
            self.flying[key] += 1
        return key

    def end(self, key: str) -> None:
        with self._lock:
            self.flying[key] -= 1
            if not self.flying[key]:
                del self.flying[key]

    def record(self, tokens: Sequence[int], key: str, generated_from: int | None = None
               ) -> None:
        """``tokens`` were computed under ``key``: their whole blocks carry it now; those
        from ``generated_from`` on were generated (None: none)."""
        with self._lock:
            self._remember(tokens, key, generated_from)
