"""The vocabulary table the server plugin constrains with.

The plugin (``plugins/seqstate-vllm``) never imports seqstate: it reads this table, written
beside the served model by ``python -m seqstate.vllm serve``, and refuses any request whose
fingerprint (`seqstate.backends.vllm.wire.fingerprint`) differs from it, so client and server
agree on every token's exact bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from seqstate.detokenize import TokenVocabulary

__all__ = ["vocabulary_table", "served_eos", "signal_tokens"]


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


def served_eos(tokenizer: Any, folder: Path | None) -> list[int]:
    """The EOS ids of a served model: its tokenizer's and its ``generation_config.json``'s
    (in ``folder``, where it is readable).  The server's table and the client's fingerprint
    both use these, so they agree."""
    ids: set[int] = set()
    generation = None
    if folder is not None:
        try:
            generation = json.loads((folder / "generation_config.json").read_text())
        except (OSError, ValueError):
            generation = None
    for source in (tokenizer.eos_token_id, (generation or {}).get("eos_token_id")):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    return sorted(ids)


def signal_tokens(table: dict[str, Any], count: int = 4) -> list[int]:
    """``count`` token ids a constrained request names as its signals (the plugin ends a
    request whose constraint is not built yet or failed with one of them, and masks them out
    of every constrained row): the last special tokens that are neither EOS nor BOS, then,
    for a tokenizer with too few, the last ids that are not EOS."""
    taken = {*table["eos"], table.get("bos")}
    special = [i for i in table["special"] if i not in taken]
    rest = [i for i in range(table["size"] - 1, -1, -1) if i not in taken and i not in special]
    return (special[::-1] + rest)[:count]
