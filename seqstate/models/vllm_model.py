"""A model served by vLLM (the ``vllm`` engine): the same states and generators, on a server."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from seqstate.backends.vllm.backend import VllmBackend
from seqstate.backends.vllm.client import Client
from seqstate.backends.vllm.vocab import VOCAB_FILE, fingerprint, served_eos, vocabulary_table
from seqstate.errors import ArgumentError, ModelMismatch, ModelNotAvailable
from seqstate.models.base import BaseModel

__all__ = ["VllmModel"]


class VllmModel(BaseModel):
    """A model on a vLLM server started with seqstate's plugin
    (``python -m seqstate.vllm serve``).

    Token ids go in and out: seqstate tokenizes with ``hf_tokenizer`` (by default the one in
    the served folder, where the server runs on this machine), so states are the same as on
    every engine.  Calls become streamed requests (vLLM batches concurrent ones and shares
    prompts through its prefix cache); constraints run inside the server.

    Parameters
    ----------
    url : str
        The server, e.g. ``"http://127.0.0.1:8000"``.
    hf_tokenizer : transformers tokenizer or None
        The served model's tokenizer; None reads it from the served folder.
    model : str or None
        Which served model (None: the only one).
    timeout : float
        Seconds to wait for the next streamed token before the call fails.
    """

    def __init__(self, url: str, hf_tokenizer: Any = None, *, model: str | None = None,
                 timeout: float = 600.0, name: str | None = None) -> None:
        client = Client(url, timeout=timeout)
        served = _served(client, model)
        folder = Path(served.get("root") or "")
        if hf_tokenizer is None:
            hf_tokenizer = _tokenizer(folder, served["id"])
        super().__init__(hf_tokenizer, name or served["id"])
        self.url = client.url
        self.folder = folder if folder.is_dir() else None
        table = vocabulary_table(self.vocab, self.eos_token_ids)
        mine = fingerprint(table)
        theirs = self.folder / VOCAB_FILE if self.folder is not None else None
        if theirs is not None and theirs.is_file() and fingerprint(json.loads(theirs.read_text())) != mine:
            raise ModelMismatch(f"the tokenizer given differs from the one the server at "
                                f"{self.url} constrains with ({theirs}); pass the served "
                                "model's tokenizer")
        context = int(served.get("max_model_len") or 2048)
        self.backend = VllmBackend(client, served["id"], self.vocab.size, mine, context)

    @property
    def context_length(self) -> int:
        """The server's ``max_model_len``."""
        return self.backend.context_length

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """The served model's EOS ids, as the server's plugin has them (`served_eos`)."""
        return frozenset(served_eos(self.hf_tokenizer, self.folder))

    def close(self) -> None:
        """Close the connection pool (the server keeps running)."""
        self.backend.close()


def _served(client: Client, model: str | None) -> dict[str, Any]:
    entries = client.get("/v1/models").get("data", [])
    if model is not None:
        entries = [e for e in entries if e.get("id") == model]
    if len(entries) != 1:
        names = [e.get("id") for e in client.get("/v1/models").get("data", [])]
        raise ArgumentError(f"the server at {client.url} serves {names}; pass model= with one "
                            "of them" if model is None else f"{model!r} is not among {names}")
    return entries[0]


def _tokenizer(folder: Path, served: str) -> Any:
    from transformers import AutoTokenizer

    if not (folder / "tokenizer_config.json").is_file():
        raise ModelNotAvailable(
            f"the served model {served!r} lives in {folder}, which is not on this machine; "
            "pass tokenizer= (the served model's transformers tokenizer)")
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
