"""Cursors: a request's constraint rebuilt from its spec, walked token by token.

The constraint's EOS rule is seqstate's: EOS only where the text so far is a complete match,
and only EOS once nothing else can follow (a dead end).  A regex or grammar is built off the
step loop (`seqstate_vllm.build`); until it is, and where it failed, went over a bound or
fails mid-way, the request is ended by one of its spec's signal tokens (`SIGNAL_KINDS`),
which it sends as stop tokens: its client reads why, never a silent EOS.

Masks are packed as llguidance packs them (token ``t`` allowed where bit ``t % 32`` of word
``t // 32`` is set): a step's grammar rows are filled together by llguidance's thread pool,
and the batch's masks go to the logits' device packed, 32 times smaller than bool masks,
to be unpacked there.
"""

from __future__ import annotations

import logging
import functools
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from seqstate_vllm.build import Built
from seqstate_vllm.table import table
from seqstate_vllm.wire import (ALLOW, BAN, BROKE, FORCE, GRAMMAR, HEAL, PENDING, REGEX, REPLAY,
                                SIGNAL_KINDS, SIGNALS)

__all__ = ["RegexCursor", "GrammarCursor", "HealCursor", "cursor_of", "Request", "mask_rows",
           "unpack", "unpack_tensor"]

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

    def allowed(self, width: int) -> np.ndarray:
        m = self.masks.get((self.state, width))
        if m is None:
            m = _only(width, self.index.get_allowed_tokens(self.state) or [])
            _set(m, table().eos, self.index.is_final_state(self.state))
            self.masks[self.state, width] = m
            if len(self.masks) > _MASKS:
                self.masks.popitem(last=False)
        return m


class GrammarCursor:
    """A copy of the compiled grammar's llguidance matcher, and its packed mask once known."""

    def __init__(self, compiled: Any) -> None:
        self.matcher = compiled.deep_copy()
        self.words: np.ndarray | None = None
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())

    def advance(self, token: int) -> bool:
        self.words = None
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    @staticmethod
    def fill(cursors: list[GrammarCursor]) -> None:
        """The cursors' masks in one call to llguidance's thread pool (no GIL held)."""
        if cursors:
            import llguidance.numpy

            packed = llguidance.numpy.allocate_token_bitmask(len(cursors), table().size)
            llguidance.numpy.fill_next_token_bitmask_par(
                _executor(), [(c.matcher, k) for k, c in enumerate(cursors)], packed)
            for c, row in zip(cursors, packed.view(np.uint32)):
                c.words = row

    def allowed(self, width: int) -> np.ndarray:
        if self.words is None:
            self.words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        t = table()
        m = np.zeros(_words(width), dtype=np.uint32)
        n = _words(t.size)
        m[:n] = self.words[:n]
        if t.size % 32:
            m[t.size // 32] &= np.uint32((1 << (t.size % 32)) - 1)
        _set(m, t.eos, self.matcher.is_accepting())
        return m


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()


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

    def allowed(self, width: int) -> np.ndarray | None:
        if not self.remaining:
            return None
        t = table()
        return _only(width, [i for i in t.by_prefix.get(self.remaining[:1], ())
                             if t.tokens[i].startswith(self.remaining)
                             or self.remaining.startswith(t.tokens[i])])


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

    def ended(self, width: int) -> np.ndarray:
        """The packed mask that ends the request: its signal's token, or EOS where it has
        none."""
        if self.signal in self.signals:
            return _only(width, [self.signals[self.signal]])
        return _only(width, table().eos)

    def fail(self, kind: str = BROKE) -> None:
        """End the request with the ``kind`` signal where it has signals (EOS otherwise)."""
        self.signal, self.dead = kind, True

    def _advance(self, token: int) -> None:
        if self.cursor is not None and not self.dead and not self.cursor.advance(token):
            self.dead = True

    def walk(self) -> None:
        """Walk the tokens generated since the last step.  The cursor starts first, so a
        request that joins with output tokens already (resumed after a preemption) has them
        walked too."""
        if self.build is not None and self.build.done():
            self._start()
        while self.build is None and self.seen < len(self.output):
            k = self.seen
            if k >= len(self.force) and self.signal is None:
                self._advance(self.output[k])
                if self.dead and self.signals:      # the mask allowed it: the cursor broke
                    self.signal = BROKE
            self.seen += 1

    def grammar(self) -> GrammarCursor | None:
        """Its grammar cursor, where the next token's mask is the cursor's and not known yet
        (walked first): the rows `mask_rows` fills together."""
        c = self.cursor
        if (isinstance(c, GrammarCursor) and c.words is None and self.build is None
                and self.signal is None and not self.dead and len(self.output) >= len(self.force)):
            return c
        return None

    def packed(self, width: int) -> np.ndarray | None:
        """Walk the tokens generated since the last step, then say which of ``width`` token
        ids the next may be (packed, uint32 (ceil(width / 32),)); None where any may."""
        self.walk()
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
                keep = keep.copy()
                _set(keep, list(self.signals.values()), False)
        if k in self.allow:
            extra = _only(width, self.allow[k])
            keep = extra if keep is None else keep & extra
        if k in self.ban:
            keep = (np.full(_words(width), 0xFFFFFFFF, dtype=np.uint32) if keep is None
                    else keep.copy())
            _set(keep, self.ban[k], False)
        return keep

    def keep(self, width: int) -> torch.Tensor | None:
        """`packed` as a bool mask (width,) on the CPU; None where any may."""
        keep = self.packed(width)
        return None if keep is None else unpack(keep[None], width, torch.device("cpu"))[0]


def _words(width: int) -> int:
    return (width + 31) // 32


def _set(keep: np.ndarray, ids, value: bool) -> None:
    """Allow (``value``) or refuse the tokens ``ids`` in the packed mask ``keep``, in place."""
    ids = np.asarray(ids, dtype=np.int64)
    bits = np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
    if value:
        np.bitwise_or.at(keep, ids >> 5, bits)
    else:
        np.bitwise_and.at(keep, ids >> 5, ~bits)


def _only(width: int, ids) -> np.ndarray:
    keep = np.zeros(_words(width), dtype=np.uint32)
    _set(keep, ids, True)
    return keep


def unpack(packed: np.ndarray, width: int, device: torch.device) -> torch.Tensor:
    """Bool masks (rows, width) on ``device`` from packed masks (rows, W): unpacked on the
    host for the CPU, else copied packed and unpacked on the device (`unpack_tensor`)."""
    if device.type == "cpu":
        bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little").view(bool)
        return torch.from_numpy(bits)[:, :width]
    return unpack_tensor(torch.from_numpy(packed.view(np.int32)).to(device, non_blocking=True),
                         width)


def unpack_tensor(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bool masks (rows, width) from packed masks (rows, W), int32 on any device, there."""
    bits = (packed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=packed.device)) & 1
    return bits.view(packed.shape[0], -1)[:, :width].bool()


def mask_rows(requests: dict[int, Request], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (batch, V), each row that ``requests`` holds a `Request` for masked (in
    place) to what its next token may be: the grammar rows' masks filled together, every
    row's mask copied to the logits' device at once (packed) and applied in one fill.  A
    request whose constraint fails here is ended (`fail`)."""
    width = logits.shape[1]
    for request in requests.values():
        try:
            request.walk()
        except Exception:
            log.exception("seqstate constraint failed mid-way; the request ends here")
            request.fail()
    grammars = [r.grammar() for r in requests.values()]
    try:
        GrammarCursor.fill([c for c in grammars if c is not None])
    except Exception:                     # each row's own mask then says what failed
        log.exception("llguidance's batched masks failed; each row computes its own")
    rows, masks = [], []
    for index, request in requests.items():
        try:
            keep = request.packed(width)
        except Exception:
            log.exception("seqstate constraint failed mid-way; the request ends here")
            request.fail()
            keep = request.ended(width)
        if keep is not None:
            rows.append(index)
            masks.append(keep)
    if rows:
        at = torch.tensor(rows, device=logits.device)
        keep = unpack(np.stack(masks), width, logits.device)                   # (rows, V)
        logits[at] = logits[at].masked_fill_(~keep, float("-inf"))
    return logits

