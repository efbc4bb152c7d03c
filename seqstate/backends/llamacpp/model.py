"""A GGUF model run by llama.cpp (the ``llama.cpp`` engine): same states, same API."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from seqstate.backends import registry
from seqstate.errors import ModelMismatch
from seqstate.models.base import BaseModel

__all__ = ["LlamaCppModel", "check_arguments"]


def _native(name: str) -> Any:
    """A module of this folder that needs llama-cpp-python (imported when a model is built,
    so that this module imports without it); `ModelNotAvailable` saying how to install it."""
    return registry.get("llama.cpp").module(name)


def check_arguments(path: str | os.PathLike, *, n_ctx: Any, n_threads: Any,
                    n_seq_max: Any) -> None:
    """Refuse, before anything is loaded, options llama.cpp would reject or misread and a
    file that is not GGUF (`ArgumentError`, `ModelNotAvailable`)."""
    _native("backend").check_options(n_ctx=n_ctx, n_threads=n_threads, n_seq_max=n_seq_max)
    _native("native").check_gguf(path)


class LlamaCppModel(BaseModel):
    """A GGUF model on llama.cpp, with the Hugging Face tokenizer of the same vocabulary.

    seqstate tokenizes with ``hf_tokenizer`` (so token ids, masks and states are the same on
    every engine) and feeds ids to llama.cpp, whose KV cache holds every stored state's
    tokens once, shared between rows through its sequences.

    Parameters
    ----------
    path : str or os.PathLike
        The GGUF file.
    hf_tokenizer : transformers.PreTrainedTokenizerFast
        A ``transformers`` fast tokenizer for the same vocabulary; one of another size is
        refused with `seqstate.ModelMismatch` (the file's unused padding ids aside).
    n_ctx : int, default 4096
        KV cells shared by every stored state and working row (the KV budget).
    n_threads : int or None
        CPU threads (default: every core this process may use).
    n_seq_max : int, default 64
        llama.cpp sequences, 4 to 256: stored branch tips plus working rows plus the two
        seqstate keeps, so at most ``n_seq_max - 3`` rows run at once.
    """

    def __init__(self, path: str | os.PathLike, hf_tokenizer: Any, *, n_ctx: int = 4096,
                 n_threads: int | None = None, n_seq_max: int = 64, quiet_logs: bool = True,
                 name: str | None = None) -> None:
        backend = _native("backend")              # ModelNotAvailable before anything else
        super().__init__(hf_tokenizer, name or Path(path).name)
        self.path = Path(path)
        # the backend checks its options and the file before llama.cpp loads anything
        self.backend = backend.LlamaCppBackend(path, n_ctx=n_ctx, n_threads=n_threads,
                                                n_seq_max=n_seq_max, quiet_logs=quiet_logs)
        mine, theirs = self.vocab.size, self.backend.vocab_size
        # a GGUF may round its vocabulary up with unused padding ids a tokenizer lacks
        if mine > theirs or (mine < theirs and not _native("native").padding_only(path, mine)):
            raise ModelMismatch(
                f"the tokenizer has {mine} tokens but {self.path.name} has {theirs}"
                f"{'' if mine > theirs else ', not all of the rest unused padding'}: they are "
                "not one vocabulary; pass the tokenizer that belongs to this GGUF file, or "
                "leave tokenizer= out to read it from the file")

    @property
    def context_length(self) -> int:
        """The longest row: the model's trained context, bounded by the KV cells (``n_ctx``)."""
        return min(self.backend.context_length, self.backend.n_ctx)

    @property
    def store(self) -> Any:
        """The radix store of llama.cpp sequences (``verify()`` checks it against llama.cpp)."""
        return self.backend.store
