"""The llama.cpp engine's options, declared once: each one's default, check and meaning.

`LlamaCppOptions` is what the loader (`ss.models.llamacpp`), the model and the backend take;
it imports no llama.cpp, so bad options are refused before anything loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from seqstate.errors import ArgumentError

__all__ = ["LlamaCppOptions", "RESERVED_SEQS", "MIN_SEQS", "MAX_SEQS"]

RESERVED_SEQS = 2             # sequences seqstate keeps: fresh evaluations', freed cells'
MIN_SEQS = RESERVED_SEQS + 2  # the reserved ones, a stored path and a working row
MAX_SEQS = 256                # llama.cpp's LLAMA_MAX_SEQ


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaCppOptions:
    """How llama.cpp runs a model; a bad value raises `seqstate.ArgumentError` when built.

    Attributes
    ----------
    n_ctx : int, default 4096
        KV cells of the unified cache, shared by every stored state and working row (the
        engine's KV budget).
    n_threads : int or None, default None
        CPU threads; None for every core this process may use.
    n_seq_max : int, default 64
        llama.cpp sequences, 4 to 256: two are kept (for fresh evaluations and for freed
        cells awaiting compaction), the others carry stored paths (one per branch tip) and
        working rows (one per row), so at most ``n_seq_max - 3`` rows run at once.
    n_batch : int, default 512
        The most tokens one ``llama_decode`` takes; longer prefills run in several.
    quiet_logs : bool, default True
        Silence llama.cpp's C log (one callback for the whole process: a ``llama_cpp.Llama``
        of your own goes quiet too); False leaves it as it is.

    Examples
    --------
    >>> LlamaCppOptions.of({"n_ctx": 2048}).max_rows
    61
    >>> LlamaCppOptions(n_seq_max=3)                  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    seqstate.errors.ArgumentError: n_seq_max must be an int in 4..256 (llama.cpp ...
    """

    n_ctx: int = 4096
    n_threads: int | None = None
    n_seq_max: int = 64
    n_batch: int = 512
    quiet_logs: bool = True

    def __post_init__(self) -> None:
        _check_int("n_ctx", self.n_ctx, 1,
                   hint="KV cells shared by every stored state and working row")
        if self.n_threads is not None:
            _check_int("n_threads", self.n_threads, 1,
                       hint="CPU threads, or None for every usable core")
        _check_int("n_seq_max", self.n_seq_max, MIN_SEQS, MAX_SEQS,
                   hint=f"llama.cpp sequences: {RESERVED_SEQS} kept by seqstate, then one per "
                        f"stored branch tip and one per working row; {MAX_SEQS} is llama.cpp's "
                        "limit")
        _check_int("n_batch", self.n_batch, 1, hint="the most tokens one llama_decode takes")
        if not isinstance(self.quiet_logs, bool):
            raise ArgumentError(f"quiet_logs must be True or False, got {self.quiet_logs!r}")

    @classmethod
    def of(cls, options: Mapping[str, Any], base: LlamaCppOptions | None = None
           ) -> LlamaCppOptions:
        """The options named in ``options``, the rest ``base``'s (by default, the defaults);
        an unknown name is an `ArgumentError` that lists the known ones."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ArgumentError(f"unknown llama.cpp engine options {unknown}; the options are "
                                f"{', '.join(known)}")
        return dataclasses.replace(base or cls(), **options)

    @property
    def max_rows(self) -> int:
        """Rows that can run at once: the sequences but the kept ones and a stored path."""
        return self.n_seq_max - RESERVED_SEQS - 1


def _check_int(name: str, value: object, lo: int, hi: int | None = None, *, hint: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) \
            and lo <= value and (hi is None or value <= hi):
        return
    bounds = f"an int in {lo}..{hi}" if hi is not None else f"an int >= {lo}"
    raise ArgumentError(f"{name} must be {bounds} ({hint}), got {value!r}")
