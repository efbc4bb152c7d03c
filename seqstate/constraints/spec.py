"""The constraint spec: what a server-side plugin rebuilds a row's constraint from.

An engine that runs seqstate's constraints inside a server (the vLLM plugin today; any
other server plugin the same way) receives, per request, a JSON object with these keys.
They are named here once: the compiled constraints' and cursors' ``remote()`` produce them,
the request engine adds replayed tokens and bans, an engine's client wraps the object in
its own envelope.  A server plugin cannot import seqstate and keeps its own copy of the
names; a test compares the two.

``regex``
    an end-anchored regex, compiled by outlines_core over the vocabulary's exact token bytes.
``grammar``
    an llguidance grammar (Lark text or its JSON form).
``heal``
    the bytes (hex) that token healing must spell first; tokens are free once they are spelled.
``replay``
    token ids the rebuilt cursor walks before the request's first output token (a regex's
    sentinel, then the tokens a sliced-back state generated under the constraint).
``force``
    ``force[k]`` is the only token allowed at output position ``k`` (scoring by forcing).
``ban``
    ``[[k, [ids]], ...]``: ids not allowed at output position ``k``.
``allow``
    ``[[k, [ids]], ...]``: only these ids allowed at output position ``k``.

At most one of ``regex``, ``grammar`` and ``heal`` is present (`CONSTRAINTS`).

Examples
--------
>>> from seqstate.constraints import spec
>>> {spec.REGEX: "(?:[0-9]+)$", spec.REPLAY: [7]}
{'regex': '(?:[0-9]+)$', 'replay': [7]}
"""

from __future__ import annotations

__all__ = ["REGEX", "GRAMMAR", "HEAL", "REPLAY", "FORCE", "BAN", "ALLOW", "CONSTRAINTS", "KEYS"]

REGEX = "regex"
GRAMMAR = "grammar"
HEAL = "heal"
REPLAY = "replay"
FORCE = "force"
BAN = "ban"
ALLOW = "allow"

CONSTRAINTS = (REGEX, GRAMMAR, HEAL)
"""The keys of which a spec has at most one: the constraint a cursor is rebuilt from."""
KEYS = frozenset({*CONSTRAINTS, REPLAY, FORCE, BAN, ALLOW})
"""Every key a spec may have (an engine's envelope adds its own, such as the vocabulary's)."""
