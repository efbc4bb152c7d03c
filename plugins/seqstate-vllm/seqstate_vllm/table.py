"""The vocabulary table: every token's exact bytes as seqstate's client sees them.

``python -m seqstate.vllm serve`` writes the table beside the served model and names it in
``$SEQSTATE_VLLM_VOCAB``; the constraints are built over it (outlines_core for regexes,
llguidance for grammars), never over the server's own detokenizer.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from seqstate_vllm.wire import VOCAB_ENV, fingerprint

__all__ = ["Table", "table"]


class Table:
    """The exact bytes of every token, as seqstate's client sees them."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.fingerprint = fingerprint(table)
        self.size = int(table["size"])
        self.eos = sorted(int(i) for i in table["eos"])
        self.bos = table.get("bos")
        self.special = frozenset(int(i) for i in table["special"])
        self.grammar_special = sorted(int(i) for i in table["grammar_special"])
        self.tokens = [bytes.fromhex(t) for t in table["tokens"]]

    @functools.cached_property
    def regex_vocabulary(self):
        from outlines_core import Vocabulary

        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.tokens):
            if b and i not in self.special and i not in self.eos:
                by_bytes.setdefault(b, []).append(i)
        return Vocabulary(self.eos[0], by_bytes)

    @functools.cached_property
    def grammar_tokenizer(self):
        import llguidance
        from llguidance import TokenizerWrapper

        table = self
        ids = {b: i for i, b in reversed(list(enumerate(self.tokens)))
               if b and i not in self.special}
        longest = max(map(len, ids), default=1)

        class _Tokens:
            """llguidance's view of the table; its encoder (used for forced text only, never
            for masks) takes the longest token at each position."""
            tokens = table.tokens
            eos_token_id = table.eos[0]
            bos_token_id = table.bos
            special_token_ids = table.grammar_special

            def __call__(self, text):
                data = text if isinstance(text, bytes) else text.encode()
                out, k = [], 0
                while k < len(data):
                    for n in range(min(longest, len(data) - k), 0, -1):
                        if data[k:k + n] in ids:
                            out.append(ids[data[k:k + n]])
                            k += n
                            break
                    else:
                        raise ValueError(f"no token spells byte {data[k]:#x}")
                return out

        return llguidance.LLTokenizer(TokenizerWrapper(_Tokens()), n_vocab=self.size)

    @functools.cached_property
    def by_prefix(self) -> dict[bytes, list[int]]:
        """Token ids by each leading byte (token healing's candidates)."""
        out: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.tokens):
            if b and i not in self.special:
                out.setdefault(b[:1], []).append(i)
        return out


@functools.lru_cache(maxsize=1)
def _load(path: str) -> Table:
    with open(path, encoding="utf-8") as f:
        return Table(json.load(f))


def table() -> Table:
    """The server's table, read once from ``$SEQSTATE_VLLM_VOCAB``."""
    path = os.environ.get(VOCAB_ENV)
    if not path:
        raise ValueError(f"this vLLM server has no seqstate vocabulary table (${VOCAB_ENV});"
                         " start it with `python -m seqstate.vllm serve`")
    return _load(path)
