"""A GGUF model run by llama.cpp (the ``llama.cpp`` engine): same states, same API."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from seqstate.backends import registry
from seqstate.backends.llamacpp.options import LlamaCppOptions
from seqstate.errors import ModelMismatch
from seqstate.models.base import BaseModel

__all__ = ["LlamaCppModel", "check_file"]


def _native(name: str) -> Any:
    """A module of this folder that needs llama-cpp-python (imported when a model is built,
    so that this module imports without it); `ModelNotAvailable` saying how to install it."""
    return registry.get("llama.cpp").module(name)


def check_file(path: str | os.PathLike) -> None:
    """Refuse, before llama.cpp reads it, a file that is not GGUF (`ModelNotAvailable`, as
    when llama-cpp-python is missing)."""
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
    options : LlamaCppOptions
        How llama.cpp runs it (KV cells, threads, sequences ...); the defaults by default.
    name : str, optional
        The model's name (default: the file's).
    """

    def __init__(self, path: str | os.PathLike, hf_tokenizer: Any,
                 options: LlamaCppOptions | None = None, *, name: str | None = None) -> None:
        backend = _native("backend")              # ModelNotAvailable before anything else
        super().__init__(hf_tokenizer, name or Path(path).name)
        self.path = Path(path)
        # the backend checks its options and the file before llama.cpp loads anything
        self.backend = backend.LlamaCppBackend(path, options)
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
