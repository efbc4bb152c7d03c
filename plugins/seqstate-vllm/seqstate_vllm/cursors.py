"""Cursors: a request's constraint rebuilt from its spec, walked token by token.

The constraint's EOS rule is seqstate's: EOS only where the text so far is a complete match,
and only EOS once nothing else can follow (a dead end).  A regex or grammar is built off the
step loop (`seqstate_vllm.build`); until it is, and where it failed, went over a bound or
fails mid-way, the request is ended by one of its spec's signal tokens (`SIGNAL_KINDS`),
which it sends as stop tokens: its client reads why, never a silent EOS.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import torch

from seqstate_vllm.build import Built
from seqstate_vllm.table import table
from seqstate_vllm.wire import (ALLOW, BAN, BROKE, FORCE, GRAMMAR, HEAL, PENDING, REGEX, REPLAY,
                                SIGNAL_KINDS, SIGNALS)

__all__ = ["RegexCursor", "GrammarCursor", "HealCursor", "cursor_of", "Request", "mask_rows"]

_MASKS = 4096           # allowed-token masks kept per compiled regex

log = logging.getLogger("seqstate_vllm")


class RegexCursor:
    """An outlines_core index state; masks cached per state on the compiled regex."""

    def __init__(self, compiled: tuple[Any, dict]) -> None:
        self.index, self.masks = compiled
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
        m = self.masks.get((self.state, width))
        if m is None:
            m = torch.zeros(width, dtype=torch.bool)
            ids = self.index.get_allowed_tokens(self.state) or []
            if ids:
                m[torch.tensor(ids, dtype=torch.long)] = True
            m[table().eos] = self.index.is_final_state(self.state)
            self.masks[self.state, width] = m
            if len(self.masks) > _MASKS:
                self.masks.popitem(last=False)
        return m


class GrammarCursor:
    """A copy of the compiled grammar's llguidance matcher."""

    def __init__(self, compiled: Any) -> None:
        self.matcher = compiled.deep_copy()
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


class HealCursor:
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


def cursor_of(spec: dict[str, Any], built: Built | None = None
              ) -> RegexCursor | GrammarCursor | HealCursor | None:
    """The cursor of the spec's constraint (a regex or grammar from its ``built`` build),
    before any token; None where it has none."""
    if REGEX in spec:
        return RegexCursor(built.compiled)
    if GRAMMAR in spec:
        return GrammarCursor(built.compiled)
    if HEAL in spec:
        return HealCursor(bytes.fromhex(spec[HEAL]))
    return None


class Request:
    """One request's constraint, kept in step with its live output-token list.

    ``build`` is the future of its regex's or grammar's build (None for any other spec):
    the cursor is made at the first step after it is done.  ``signal`` names the signal
    kind the request is being ended with, once one is chosen."""

    def __init__(self, spec: dict[str, Any], output: list[int], build: Future | None) -> None:
        self.spec, self.output, self.build = spec, output, build
        self.seen = 0
        self.force = [int(t) for t in spec.get(FORCE, ())]
        self.ban = {int(k): [int(i) for i in ids] for k, ids in spec.get(BAN, ())}
        self.allow = {int(k): [int(i) for i in ids] for k, ids in spec.get(ALLOW, ())}
        self.signals = dict(zip(SIGNAL_KINDS, spec.get(SIGNALS, ())))
        self.dead = False
        self.signal: str | None = None
        self.cursor: Any = None
        if build is None:
            self.cursor = cursor_of(spec)

    def _start(self) -> None:
        """The cursor from the finished build, its replayed tokens walked; or the signal
        that the build failed or went over a bound."""
        built = self.build.result()
        self.build = None
        if built.failure is not None:
            self.signal = built.failure
            return
        self.cursor = cursor_of(self.spec, built)
        for token in self.spec.get(REPLAY, ()):
            self._advance(int(token))
        if self.dead:                 # a replayed token the constraint refuses
            self.signal = BROKE

    def ended(self, width: int) -> torch.Tensor:
        """The mask that ends the request: its signal's token, or EOS where it has none."""
        if self.signal in self.signals:
            return _only(width, [self.signals[self.signal]])
        return _only(width, table().eos)

    def fail(self, kind: str = BROKE) -> None:
        """End the request with the ``kind`` signal where it has signals (EOS otherwise)."""
        self.signal, self.dead = kind, True

    def _advance(self, token: int) -> None:
        if self.cursor is not None and not self.dead and not self.cursor.advance(token):
            self.dead = True

    def keep(self, width: int) -> torch.Tensor | None:
        """Walk the tokens generated since the last step, then say which of ``width`` token
        ids the next may be (a bool mask on the CPU); None where any may.

        The cursor starts first, so a request that joins with output tokens already (resumed
        after a preemption) has them walked too."""
        if self.build is not None and self.build.done():
            self._start()
        while self.build is None and self.seen < len(self.output):
            k = self.seen
            if k >= len(self.force) and self.signal is None:
                self._advance(self.output[k])
                if self.dead and self.signals:      # the mask allowed it: the cursor broke
                    self.signal = BROKE
            self.seen += 1
        k = len(self.output)
        if self.build is not None and self.signal is None:
            self.signal = PENDING
        if self.signal is not None:
            return self.ended(width)
        if k < len(self.force):
            keep = _only(width, [self.force[k]])
        elif self.dead:
            keep = _only(width, table().eos)
        else:
            keep = None if self.cursor is None else self.cursor.allowed(width)
            if keep is not None and not keep.any():
                keep = _only(width, table().eos)
            if keep is not None and self.signals:           # never a signal by chance
                keep = keep.clone()
                keep[list(self.signals.values())] = False
        if k in self.allow:
            extra = _only(width, self.allow[k])
            keep = extra if keep is None else keep & extra
        if k in self.ban:
            keep = (torch.ones(width, dtype=torch.bool) if keep is None else keep.clone())
            keep[self.ban[k]] = False
        return keep


def _only(width: int, ids) -> torch.Tensor:
    keep = torch.zeros(width, dtype=torch.bool)
    keep[ids] = True
    return keep


def mask_rows(requests: dict[int, Request], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (batch, V), each row that ``requests`` holds a `Request` for masked (in
    place) to what its next token may be: every row at once, one copy of the masks to the
    logits' device and one fill.  A request whose constraint fails here is ended (`fail`)."""
    rows, masks = [], []
    width = logits.shape[1]
    for index, request in requests.items():
        try:
            keep = request.keep(width)
        except Exception:
            log.exception("seqstate constraint failed mid-way; the request ends here")
            request.fail()
            keep = request.ended(width)
        if keep is not None:
            rows.append(index)
            masks.append(keep)
    if rows:
        at = torch.tensor(rows, device=logits.device)
        keep = torch.stack(masks).to(logits.device, non_blocking=True)       # (rows, V)
        logits[at] = logits[at].masked_fill_(~keep, float("-inf"))
    return logits
