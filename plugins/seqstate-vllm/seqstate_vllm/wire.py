"""The names this plugin shares with seqstate's client, and the vocabulary fingerprint.

A request opts in with ``vllm_xargs={"seqstate": "<json>"}``; the JSON object says, for that
request:

``vocab``
    the fingerprint of the client's vocabulary table; a request whose fingerprint differs
    from the server's table (``$SEQSTATE_VLLM_VOCAB``, written by ``serve``) is refused.
``regex`` / ``grammar`` / ``heal``
    at most one constraint: an anchored regex (outlines_core over the table's exact token
    bytes), an llguidance grammar (Lark text or its JSON form), or the bytes (hex) that token
    healing must spell first.
``replay``
    tokens already generated under the constraint (a state sliced back and resumed): the
    cursor walks them before the request's first output token.
``force``
    output position ``k`` must be ``force[k]`` (scoring by forcing: the raw log-probs of the
    forced tokens come back with the prefix cache kept).
``ban``
    ``[[k, [ids]], ...]``: ids not allowed at output position ``k``.
``allow``
    ``[[k, [ids]], ...]``: only these ids at output position ``k`` (an explicit mask).
``signals``
    with a regex or grammar (required there): four token ids the constraint never allows,
    in `SIGNAL_KINDS` order, that the request also sends as ``stop_token_ids``.  The plugin
    ends the request with one of them where the constraint is not ready or has failed, so
    the client reads why from the choice's ``stop_reason`` instead of a silent EOS.

seqstate declares the same names in ``seqstate.backends.vllm.wire`` and
``seqstate.constraints.spec``; this package cannot import seqstate, so it keeps a copy, and
seqstate's ``tests/test_vllm_wire.py`` fails where the two differ.  This module imports
nothing beyond the standard library.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["XARGS_KEY", "VOCAB_KEY", "VOCAB_ENV", "REGEX", "GRAMMAR", "HEAL", "REPLAY",
           "FORCE", "BAN", "ALLOW", "SIGNALS", "SIGNAL_KINDS", "PENDING", "FAILED", "BOUND",
           "BROKE", "CONSTRAINTS", "KEYS", "fingerprint"]

XARGS_KEY = "seqstate"
VOCAB_KEY = "vocab"
VOCAB_ENV = "SEQSTATE_VLLM_VOCAB"

REGEX = "regex"
GRAMMAR = "grammar"
HEAL = "heal"
REPLAY = "replay"
FORCE = "force"
BAN = "ban"
ALLOW = "allow"
SIGNALS = "signals"
CONSTRAINTS = (REGEX, GRAMMAR, HEAL)
KEYS = frozenset({VOCAB_KEY, *CONSTRAINTS, REPLAY, FORCE, BAN, ALLOW, SIGNALS})

# what each of the request's ``signals`` says, in order: the constraint is still being built
# (send the request again), it failed to build, it went over the server's bounds (time or
# memory), it failed mid-way (after some tokens)
PENDING = "pending"
FAILED = "failed"
BOUND = "bound"
BROKE = "broke"
SIGNAL_KINDS = (PENDING, FAILED, BOUND, BROKE)


def fingerprint(table: dict[str, Any]) -> str:
    """The vocabulary's fingerprint: sha256 of its canonical JSON (seqstate computes the same)."""
    text = json.dumps(table, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()
