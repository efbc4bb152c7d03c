"""A request's spec checked at admission: its shape, its types and its sizes.

vLLM calls `check` (through the processor's ``validate_params``) in the API server before the
request reaches the engine, and answers a `SpecError` with HTTP 400 and its message.  So
whatever a client sends, the engine's step loop only ever sees a spec of the right shape,
within these bounds.  Building the constraint (which may still fail, or go over the time
and memory bounds, `seqstate_vllm.build`) happens later, off the step loop.

This module imports nothing beyond the standard library (seqstate's tests fuzz it).
"""

from __future__ import annotations

import json
from typing import Any

from seqstate_vllm.wire import (ALLOW, BAN, CONSTRAINTS, FORCE, GRAMMAR, HEAL, KEYS, REGEX,
                                REPLAY, SIGNAL_KINDS, SIGNALS, VOCAB_KEY)

__all__ = ["SpecError", "check", "MAX_CONSTRAINT_CHARS", "MAX_HEAL_BYTES", "MAX_IDS"]

MAX_CONSTRAINT_CHARS = 1 << 18     # a regex's or grammar's text (a large JSON schema's is ~40k)
MAX_HEAL_BYTES = 256               # what token healing re-spells is one token's tail
MAX_IDS = 1 << 18                  # token ids in one spec, all its lists together


class SpecError(ValueError):
    """A spec the plugin refuses at admission (vLLM answers HTTP 400 with the message)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"seqstate spec refused: {message}")


def check(raw: Any, fingerprint: str, size: int) -> dict[str, Any]:
    """The spec ``raw`` (its JSON text or the parsed object) checked against a server whose
    table has ``fingerprint`` and ``size`` tokens; `SpecError` saying what is wrong."""
    if isinstance(raw, (str, bytes)):
        if len(raw) > 2 * MAX_CONSTRAINT_CHARS + 16 * MAX_IDS:
            raise SpecError(f"{len(raw)} characters is over the bound on a spec")
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise SpecError(f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(map(str, set(raw) - KEYS))
    if unknown:
        raise SpecError(f"unknown keys {unknown}; the keys are {sorted(KEYS)}")
    if sum(k in raw for k in CONSTRAINTS) > 1:
        raise SpecError(f"at most one of {', '.join(CONSTRAINTS)}")
    if raw.get(VOCAB_KEY) != fingerprint:
        raise SpecError("seqstate vocabulary mismatch: the client's tokenizer differs from the "
                        "one this server was started with (fingerprint "
                        f"{str(raw.get(VOCAB_KEY))[:12]} vs {fingerprint[:12]})")
    for key in (REGEX, GRAMMAR):
        if key in raw:
            _text(raw[key], key)
    if HEAL in raw:
        _heal(raw[HEAL])
    budget = [MAX_IDS]
    for key in (REPLAY, FORCE):
        if key in raw:
            _ids(raw[key], key, size, budget)
    for key in (BAN, ALLOW):
        if key in raw:
            _positions(raw[key], key, size, budget)
    if REGEX in raw or GRAMMAR in raw:
        if SIGNALS not in raw:
            raise SpecError(f"a {REGEX} or {GRAMMAR} needs {SIGNALS}: {len(SIGNAL_KINDS)} "
                            f"token ids, for {', '.join(SIGNAL_KINDS)}")
    if SIGNALS in raw:
        signals = _ids(raw[SIGNALS], SIGNALS, size, budget)
        if len(signals) != len(SIGNAL_KINDS) or len(set(signals)) != len(signals):
            raise SpecError(f"{SIGNALS} must be {len(SIGNAL_KINDS)} distinct token ids "
                            f"({', '.join(SIGNAL_KINDS)}), got {signals[:8]}")
    return raw


def _text(value: Any, key: str) -> None:
    if not isinstance(value, str):
        raise SpecError(f"{key} must be a string, got {type(value).__name__}")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise SpecError(f"{key} of {len(value)} characters is over the bound of "
                        f"{MAX_CONSTRAINT_CHARS}")


def _heal(value: Any) -> None:
    if not isinstance(value, str) or len(value) > 2 * MAX_HEAL_BYTES:
        raise SpecError(f"{HEAL} must be hex of at most {MAX_HEAL_BYTES} bytes")
    try:
        bytes.fromhex(value)
    except ValueError:
        raise SpecError(f"{HEAL} is not hex: {value[:40]!r}") from None


def _ids(value: Any, key: str, size: int, budget: list[int]) -> list[int]:
    """``value`` as a list of token ids below ``size``, counted against ``budget``."""
    if not isinstance(value, list):
        raise SpecError(f"{key} must be a list of token ids, got {type(value).__name__}")
    budget[0] -= len(value)
    if budget[0] < 0:
        raise SpecError(f"over the bound of {MAX_IDS} token ids in one spec")
    for token in value:
        if type(token) is not int or not 0 <= token < size:
            raise SpecError(f"{key} holds {str(token)[:40]}, not a token id in [0, {size})")
    return value


def _positions(value: Any, key: str, size: int, budget: list[int]) -> None:
    """``value`` as ``[[position, [ids]], ...]``."""
    if not isinstance(value, list):
        raise SpecError(f"{key} must be a list of [position, [ids]], got {type(value).__name__}")
    for entry in value:
        if (not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) is not int
                or entry[0] < 0):
            raise SpecError(f"{key} holds {str(entry)[:40]}, not [position, [ids]]")
        _ids(entry[1], key, size, budget)
