"""seqstate's constraints inside a vLLM server: a V1 logits processor.

Started by ``python -m seqstate.vllm serve`` as
``--logits-processors seqstate_vllm:SeqStateLogitsProcessor``.  A request opts in with
``vllm_xargs={"seqstate": "<json>"}``; the JSON object says, for that request:

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

The constraint's EOS rule is seqstate's: EOS only where the text so far is a complete match,
and only EOS once nothing else can follow.  A constraint that cannot continue (a dead end, or
a constraint that failed to build) allows EOS alone, so the request ends there.

This package never imports seqstate: the server's environment has only vLLM's dependencies.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections import OrderedDict
from typing import Any

import torch

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

__all__ = ["SeqStateLogitsProcessor", "Table", "fingerprint", "VOCAB_ENV"]

VOCAB_ENV = "SEQSTATE_VLLM_VOCAB"
_KEYS = {"vocab", "regex", "grammar", "heal", "replay", "force", "ban", "allow"}
_MASKS = 4096           # allowed-token masks kept per compiled regex

log = logging.getLogger("seqstate_vllm")


def fingerprint(table: dict[str, Any]) -> str:
    """The vocabulary's fingerprint: sha256 of its canonical JSON (seqstate computes the same)."""
    text = json.dumps(table, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


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
    path = os.environ.get(VOCAB_ENV)
    if not path:
        raise ValueError("this vLLM server has no seqstate vocabulary table ($SEQSTATE_VLLM_VOCAB);"
                         " start it with `python -m seqstate.vllm serve`")
    return _load(path)


def parse(params) -> dict[str, Any] | None:
    """The request's seqstate spec, checked; None where it has none."""
    extra = getattr(params, "extra_args", None) or {}
    raw = extra.get("seqstate")
    if raw is None:
        return None
    spec = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(spec, dict) or not set(spec) <= _KEYS:
        raise ValueError(f"seqstate spec must be an object with keys from {sorted(_KEYS)}")
    if sum(k in spec for k in ("regex", "grammar", "heal")) > 1:
        raise ValueError("a seqstate spec has at most one of regex, grammar, heal")
    if spec.get("vocab") != table().fingerprint:
        raise ValueError("seqstate vocabulary mismatch: the client's tokenizer differs from the "
                         "one this server was started with (fingerprint "
                         f"{str(spec.get('vocab'))[:12]} vs {table().fingerprint[:12]})")
    return spec


# -- constraints --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _regex(pattern: str) -> tuple[Any, OrderedDict]:
    from outlines_core import Index

    return Index(pattern, table().regex_vocabulary), OrderedDict()


@functools.lru_cache(maxsize=64)
def _grammar(grammar: str):
    import llguidance

    return llguidance.LLMatcher(table().grammar_tokenizer, grammar, log_level=0)


class _Regex:
    def __init__(self, pattern: str) -> None:
        self.index, self.masks = _regex(pattern)
        self.state = self.index.get_initial_state()

    def advance(self, token: int) -> bool:
        if token in table().eos:
            return False
        nxt = self.index.get_next_state(self.state, token)
        if nxt is None:
            return False
        self.state = nxt
        return True

    def allowed(self, width: int) -> torch.Tensor:
        m = self.masks.get(self.state)
        if m is None:
            m = torch.zeros(width, dtype=torch.bool)
            ids = self.index.get_allowed_tokens(self.state) or []
            if ids:
                m[torch.tensor(ids, dtype=torch.long)] = True
            m[table().eos] = self.index.is_final_state(self.state)
            self.masks[self.state] = m
            if len(self.masks) > _MASKS:
                self.masks.popitem(last=False)
        return m


class _Grammar:
    def __init__(self, grammar: str) -> None:
        self.matcher = _grammar(grammar).deep_copy()
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())

    def advance(self, token: int) -> bool:
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    def allowed(self, width: int) -> torch.Tensor:
        import numpy as np

        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[: table().size].astype(bool)
        m = torch.zeros(width, dtype=torch.bool)
        m[: bits.shape[0]] = torch.from_numpy(bits)
        m[table().eos] = self.matcher.is_accepting()
        return m


class _Heal:
    """Tokens that continue spelling ``remaining``; free once it is spelled."""

    def __init__(self, remaining: bytes) -> None:
        self.remaining = remaining

    def advance(self, token: int) -> bool:
        b = table().tokens[token]
        if len(b) < len(self.remaining) and self.remaining.startswith(b):
            self.remaining = self.remaining[len(b):]
        elif b.startswith(self.remaining) or self.remaining.startswith(b):
            self.remaining = b""
        else:
            return False
        return True

    def allowed(self, width: int) -> torch.Tensor | None:
        if not self.remaining:
            return None
        t = table()
        m = torch.zeros(width, dtype=torch.bool)
        ids = [i for i in t.by_prefix.get(self.remaining[:1], ())
               if t.tokens[i].startswith(self.remaining) or self.remaining.startswith(t.tokens[i])]
        if ids:
            m[torch.tensor(ids, dtype=torch.long)] = True
        return m


class _Request:
    """One request's constraint, kept in step with its live output-token list."""

    def __init__(self, spec: dict[str, Any], output: list[int]) -> None:
        self.output = output
        self.seen = 0
        self.force = [int(t) for t in spec.get("force", ())]
        self.ban = {int(k): [int(i) for i in ids] for k, ids in spec.get("ban", ())}
        self.allow = {int(k): [int(i) for i in ids] for k, ids in spec.get("allow", ())}
        self.dead = False
        self.cursor: Any = None
        try:
            if "regex" in spec:
                self.cursor = _Regex(spec["regex"])
            elif "grammar" in spec:
                self.cursor = _Grammar(spec["grammar"])
            elif "heal" in spec:
                self.cursor = _Heal(bytes.fromhex(spec["heal"]))
            for token in spec.get("replay", ()):
                self._advance(int(token))
        except Exception:
            log.exception("seqstate constraint failed to build; the request ends here")
            self.dead = True

    def _advance(self, token: int) -> None:
        if self.cursor is not None and not self.dead and not self.cursor.advance(token):
            self.dead = True

    def apply(self, row: torch.Tensor) -> None:
        while self.seen < len(self.output):
            k = self.seen
            if k >= len(self.force):
                self._advance(self.output[k])
            self.seen += 1
        k = len(self.output)
        width = row.shape[0]
        if k < len(self.force):
            keep = torch.zeros(width, dtype=torch.bool)
            keep[self.force[k]] = True
        elif self.dead:
            keep = torch.zeros(width, dtype=torch.bool)
            keep[table().eos] = True
        else:
            keep = None if self.cursor is None else self.cursor.allowed(width)
            if keep is not None and not keep.any():
                keep = torch.zeros(width, dtype=torch.bool)
                keep[table().eos] = True
        if k in self.allow:
            extra = torch.zeros(width, dtype=torch.bool)
            extra[self.allow[k]] = True
            keep = extra if keep is None else keep & extra
        if k in self.ban:
            keep = (torch.ones(width, dtype=torch.bool) if keep is None else keep.clone())
            keep[self.ban[k]] = False
        if keep is not None:
            row.masked_fill_(~keep.to(row.device), float("-inf"))


class SeqStateLogitsProcessor(LogitsProcessor):
    """The V1 logits processor: one `_Request` per batch index that carries a seqstate spec."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        parse(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.requests: dict[int, _Request] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.requests.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            spec = parse(params)
            if spec is None:
                self.requests.pop(index, None)
            else:
                self.requests[index] = _Request(spec, output)
        for a, b, direction in batch_update.moved:
            first, second = self.requests.pop(a, None), self.requests.pop(b, None)
            if first is not None:
                self.requests[b] = first
            if second is not None and direction == MoveDirectionality.SWAP:
                self.requests[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, request in self.requests.items():
            try:
                request.apply(logits[index])
            except Exception:
                log.exception("seqstate constraint failed; the request ends here")
                request.dead = True
                logits[index].fill_(float("-inf"))
                logits[index, table().eos] = 0.0
        return logits
