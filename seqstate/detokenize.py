"""Exact token bytes, incremental UTF-8-safe detokenization and stop-string hold-back.

A token is a byte string.  Texts are decoded from the concatenated bytes, so a character split
over two tokens is never mangled, and character offsets map back to token boundaries exactly.
"""

from __future__ import annotations

import bisect
import codecs
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

from seqstate.errors import ArgumentError

__all__ = ["TokenVocabulary", "IncrementalDecoder", "StopMatcher"]

_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


_SEP = "\x00"


def _split_joined(joined: bytes, n: int) -> list[bytes] | None:
    parts = joined.split(_SEP.encode())
    return parts if len(parts) == n else None


def _byte_level_bytes(pieces: list[str]) -> list[bytes]:
    """GPT-2 byte-level pieces to bytes: the whole vocabulary in one translate when every piece
    is byte-level (added tokens are replaced after), else piece by piece."""
    alphabet = _byte_level_alphabet()
    joined = _SEP.join(pieces)
    if set(joined) <= alphabet.keys() | {_SEP}:
        table = {ord(c): b for c, b in alphabet.items()}
        out = _split_joined(joined.translate(table).encode("latin-1"), len(pieces))
        if out is not None:
            return out
    return [bytes(alphabet[c] for c in p) if all(c in alphabet for c in p) else p.encode()
            for p in pieces]


def _sentencepiece_bytes(pieces: list[str]) -> list[bytes]:
    """SentencePiece pieces to bytes: U+2581 is a space, ``<0xAB>`` a single byte."""
    out = _split_joined(_SEP.join(pieces).replace("\u2581", " ").encode(), len(pieces))
    if out is None:
        out = [p.replace("\u2581", " ").encode() for p in pieces]
    for i, p in enumerate(pieces):
        if len(p) == 6 and p.startswith("<0x") and (m := _HEX_BYTE.match(p)):
            out[i] = bytes([int(m.group(1), 16)])
    return out


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible map from the 256 byte values to printable characters, inverted."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenVocabulary:
    """The exact bytes of every token id of a Hugging Face tokenizer.

    One per tokenizer: `TokenVocabulary.of` returns the same object for the same tokenizer,
    so its tables (built lazily, once) serve every model, engine and generator sharing it.
    ``tables`` is where other layers keep what they derive from the vocabulary (a constraint
    library's token table), built once per tokenizer too.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerFast
        A ``transformers`` fast tokenizer.

    Examples
    --------
    >>> import seqstate as ss
    >>> vocab = ss.models.testing.tiny().vocab
    >>> vocab.decode(vocab.encode("café"))
    'café'
    """

    _shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _shared_lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer) -> TokenVocabulary:
        """The vocabulary of ``tokenizer``, shared by everything that uses that tokenizer."""
        with cls._shared_lock:
            vocab = cls._shared.get(tokenizer)
            if vocab is None:
                vocab = cls._shared[tokenizer] = cls(tokenizer)
            return vocab

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.size = max(len(tokenizer), getattr(tokenizer, "vocab_size", 0))
        # the decoder alone (the whole tokenizer's JSON is tens of MB on a 262k vocabulary)
        decoder = tokenizer.backend_tokenizer.decoder
        self.byte_level = decoder is not None and b"ByteLevel" in decoder.__getstate__()
        self.added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self.special_ids = frozenset(tokenizer.all_special_ids) | frozenset(
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
        self.tables: dict = {}
        self.lock = threading.Lock()

    def table(self, key: Any, build: Callable[[], Any]) -> Any:
        """``tables[key]``, built by ``build()`` the first time (once, under a lock)."""
        with self.lock:
            if key not in self.tables:
                self.tables[key] = build()
            return self.tables[key]

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """``token_bytes[i]`` is the exact byte string token ``i`` stands for."""
        # the id -> piece table, inverted from the backend's piece -> id dict at once (a
        # per-id lookup costs a Python call per token, slow on a 262k vocabulary)
        pieces = [""] * self.size
        for piece, i in self.tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True).items():
            if i < self.size:
                pieces[i] = piece
        if self.byte_level:
            out = _byte_level_bytes(pieces)
        else:
            out = _sentencepiece_bytes(pieces)
        for i, content in self.added.items():
            if i < self.size:
                out[i] = content.encode()
        return out

    @cached_property
    def token_text(self) -> list[str | None]:
        """``token_text[i]``: token ``i``'s text where its bytes are whole UTF-8 characters on
        their own, else None (a piece of a character: only a decoder can join it)."""
        return [_whole_text(b) for b in self.token_bytes]

    @cached_property
    def sorted_bytes(self) -> tuple[list[bytes], list[int]]:
        """Token bytes in sorted order with their ids: tokens sharing a prefix are contiguous."""
        pairs = sorted((b, i) for i, b in enumerate(self.token_bytes)
                       if b and i not in self.special_ids)
        return [b for b, _ in pairs], [i for _, i in pairs]

    def ids_with_prefix(self, prefix: bytes) -> list[int]:
        """Ids of the (non-special) tokens whose bytes start with ``prefix``."""
        keys, ids = self.sorted_bytes
        lo = bisect.bisect_left(keys, prefix)
        hi = lo
        while hi < len(keys) and keys[hi].startswith(prefix):
            hi += 1
        return ids[lo:hi]

    def ids_of(self, piece: bytes) -> list[int]:
        """Ids of the (non-special) tokens whose bytes are exactly ``piece``."""
        keys, ids = self.sorted_bytes
        lo = hi = bisect.bisect_left(keys, piece)
        while hi < len(keys) and keys[hi] == piece:
            hi += 1
        return ids[lo:hi]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as text appended to a state: no special tokens added."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False)
        except (TypeError, ValueError):
            _check_text(text)
            raise

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of ``text`` as the tokenizer encodes a prompt (``tokenizer(text)``): with
        the BOS token and whatever else it adds."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=True)
        except (TypeError, ValueError):
            _check_text(text)
            raise

    @cached_property
    def prompt_start(self) -> tuple[int, ...]:
        """The special tokens the tokenizer puts before a prompt's text (``(bos,)`` or ``()``)."""
        bare = self.encode("a")
        full = self.encode_prompt("a")
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                return tuple(full[:i])
        return ()

    def strip_prompt_start(self, ids: Sequence[int]) -> Sequence[int]:
        """``ids`` without the leading `prompt_start` tokens, where they begin with them."""
        lead = self.prompt_start
        return ids[len(lead):] if lead and tuple(ids[:len(lead)]) == lead else ids

    def bytes_of(self, ids: Sequence[int]) -> bytes:
        tb = self.token_bytes
        return b"".join(tb[i] for i in ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; an incomplete trailing character shows as U+FFFD."""
        return self.bytes_of(ids).decode("utf-8", errors="replace")

    def char_prefix_tokens(self, ids: Sequence[int], n_chars: int) -> tuple[int, str]:
        """How many whole tokens of ``ids`` fit in the first ``n_chars`` characters of their text.

        Returns ``(k, rest)``: ``ids[:k]`` decodes to a prefix of the cut text and ``rest`` is the
        remaining text up to ``n_chars`` that must be re-encoded.
        """
        text = self.decode(ids)
        target = text[:n_chars]
        limit = len(target.encode("utf-8", errors="replace"))
        used, k = 0, 0
        for t in ids:
            nb = len(self.token_bytes[t])
            if used + nb > limit:
                break
            used += nb
            k += 1
        kept = self.bytes_of(ids[:k]).decode("utf-8", errors="replace")
        # a token ending inside a multibyte char decodes with U+FFFD: step back to a char boundary
        while k and not target.startswith(kept):
            k -= 1
            kept = self.bytes_of(ids[:k]).decode("utf-8", errors="replace")
        return k, target[len(kept):]


def _whole_text(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _check_text(text: Any) -> None:
    """`seqstate.ArgumentError` where ``text`` is not text a tokenizer can encode: not a str,
    or a str that is not valid Unicode (a lone surrogate, as a bad ``\\ud83d`` escape or a
    file read with ``errors="surrogateescape"`` leaves)."""
    if not isinstance(text, str):
        raise ArgumentError(f"text to encode is a str, got {type(text).__name__} {text!r:.60}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ArgumentError(f"the text holds a lone surrogate {text[exc.start]!r} at character "
                            f"{exc.start} ({text[max(0, exc.start - 20): exc.start + 1]!r}), "
                            "which is not Unicode text; repair it first, e.g. "
                            "text.encode('utf-16', 'surrogatepass').decode('utf-16') for a "
                            "split pair, or text.encode('utf-8', 'replace').decode()") from None


class IncrementalDecoder:
    """Turns a stream of token ids into text chunks that never split a character."""

    def __init__(self, vocab: TokenVocabulary) -> None:
        self._vocab = vocab
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if not self._dec.buffer:             # no character pending: a whole token's own text
            text = self._vocab.token_text[token]
            if text is not None:
                return text
        return self._dec.decode(self._vocab.token_bytes[token])

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)

    @property
    def pending(self) -> bytes:
        """The bytes of a character not complete yet."""
        return self._dec.getstate()[0]

    def copy(self) -> IncrementalDecoder:
        twin = IncrementalDecoder(self._vocab)
        twin._dec.setstate(self._dec.getstate())
        return twin


class StopMatcher:
    """Finds stop strings in generated text, across token boundaries.

    ``find(text)`` returns the end offset of the earliest complete stop string in ``text`` (or
    -1); ``holdback(text)`` is how many trailing characters might still begin a stop string and
    so must not be streamed yet.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int = 0) -> tuple[int, int]:
        """``(begin, end)`` of the earliest stop string found at or after ``start``; (-1, -1) if none."""
        best = (-1, -1)
        for s in self.stops:
            i = text.find(s, max(0, start))
            if i >= 0 and (best[0] < 0 or i < best[0]):
                best = (i, i + len(s))
        return best

    def holdback(self, text: str) -> int:
        for n in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
