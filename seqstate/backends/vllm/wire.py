"""What seqstate's vLLM client and its server plugin agree on: the request envelope and the
vocabulary table's file, variable and fingerprint.

A request opts in to the plugin (``plugins/seqstate-vllm``) with ``vllm_xargs`` holding one
entry, `XARGS_KEY`, whose value is a JSON object: the engine-neutral constraint spec
(`seqstate.constraints.spec`) plus `VOCAB_KEY`, the fingerprint of the client's vocabulary
table, and with a regex or grammar `SIGNALS`: token ids, one per `SIGNAL_KINDS`, that the
request also sends as ``stop_token_ids``.  The plugin ends a request with one of them where
its constraint is still being built (`PENDING`: the client sends it again), failed to build
(`FAILED`), went over the server's time or memory bound (`BOUND`) or failed mid-way
(`BROKE`); the client reads which from the choice's ``stop_reason``.

``python -m seqstate.vllm serve`` writes the table as `VOCAB_FILE` beside the served model
and names it to the plugin in `VOCAB_ENV`; the plugin refuses a request whose fingerprint
differs from its table's.  The plugin cannot import seqstate and keeps its own copy of these
names and of `fingerprint`; ``tests/test_vllm_wire.py`` compares the two.

Examples
--------
>>> from seqstate.backends.vllm.wire import vllm_xargs
>>> vllm_xargs("ab12", {"regex": "(?:yes|no)$"})
{'seqstate': '{"vocab": "ab12", "regex": "(?:yes|no)$"}'}
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["XARGS_KEY", "VOCAB_KEY", "VOCAB_FILE", "VOCAB_ENV", "SIGNALS", "SIGNAL_KINDS",
           "PENDING", "FAILED", "BOUND", "BROKE", "PLUGINS", "fingerprint", "vllm_xargs"]

# the plugin's processor for each model runner (``--logits-processors``): V1's interface,
# Model Runner V2's
PLUGINS = {False: "seqstate_vllm:SeqStateLogitsProcessor",
           True: "seqstate_vllm:SeqStateLogitsProcessorV2"}
XARGS_KEY = "seqstate"
"""The ``vllm_xargs`` entry the plugin reads (vLLM passes it as ``SamplingParams.extra_args``)."""
VOCAB_KEY = "vocab"
"""The spec entry holding the client's vocabulary fingerprint."""
VOCAB_FILE = "seqstate-vocab.json"
"""The vocabulary table's file name, in the served model's folder."""
VOCAB_ENV = "SEQSTATE_VLLM_VOCAB"
"""The environment variable that gives the server's plugin the table's path."""
SIGNALS = "signals"
"""The spec entry naming a constrained request's signal tokens, in `SIGNAL_KINDS` order."""
PENDING = "pending"
FAILED = "failed"
BOUND = "bound"
BROKE = "broke"
SIGNAL_KINDS = (PENDING, FAILED, BOUND, BROKE)
"""What each signal token says: built yet? failed, over a bound, failed mid-way."""


def fingerprint(table: dict[str, Any]) -> str:
    """sha256 of the vocabulary table's canonical JSON (the plugin computes the same)."""
    text = json.dumps(table, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def vllm_xargs(vocab: str, spec: dict[str, Any]) -> dict[str, str]:
    """A request's ``vllm_xargs``: the constraint ``spec`` for a client whose vocabulary
    fingerprint is ``vocab``."""
    return {XARGS_KEY: json.dumps({VOCAB_KEY: vocab, **spec})}
