"""The vocabulary table the server plugin constrains with, and its fingerprint.

The plugin (``plugins/seqstate-vllm``) never imports seqstate: it reads this table, written
beside the served model by ``python -m seqstate.vllm serve``, and refuses any request whose
fingerprint differs from it, so client and server agree on every token's exact bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from seqstate.detokenize import TokenVocabulary

__all__ = ["vocabulary_table", "fingerprint", "VOCAB_FILE"]

VOCAB_FILE = "seqstate-vocab.json"


def vocabulary_table(vocab: TokenVocabulary, eos: Iterable[int]) -> dict[str, Any]:
    """Every token's exact bytes (hex), the EOS ids, and which ids no text spells: what
    seqstate's regex (outlines_core) and grammar (llguidance) constraints are built over."""
    tokenizer = vocab.tokenizer
    return {
        "size": vocab.size,
        "eos": sorted(set(eos)),
        "bos": tokenizer.bos_token_id,
        "special": sorted(vocab.special_ids),
        # as llguidance's HF import (and seqstate's grammar constraints) have it
        "grammar_special": sorted(
            i for i, t in tokenizer.added_tokens_decoder.items()
            if t.special or (t.content.startswith("<") and t.content.endswith(">"))),
        "tokens": [b.hex() for b in vocab.token_bytes],
    }


def fingerprint(table: dict[str, Any]) -> str:
    """sha256 of the table's canonical JSON (the plugin computes the same)."""
    text = json.dumps(table, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()
