"""A model served by vLLM (the ``vllm`` engine): the same states and generators, on a server."""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

from seqstate.backends.vllm.backend import VllmBackend
from seqstate.backends.vllm.client import Client
from seqstate.backends.vllm.vocab import served_eos, signal_tokens, vocabulary_table
from seqstate.backends.vllm.wire import VOCAB_FILE, fingerprint
from seqstate.errors import ArgumentError, ModelMismatch, ModelNotAvailable
from seqstate.models.base import BaseModel

__all__ = ["VllmModel", "API_KEY_ENV"]

API_KEY_ENV = "SEQSTATE_VLLM_API_KEY"


class VllmModel(BaseModel):
    """A model on a vLLM server started with seqstate's plugin
    (``python -m seqstate.vllm serve``).

    Made by `seqstate.models.vllm` (``ss.models.vllm(url, tokenizer=...)``), which passes
    its arguments here.  Token ids go in and out: seqstate tokenizes with ``tokenizer`` (by
    default the one in the served folder, where the server runs on this machine; afterwards
    it is ``model.hf_tokenizer``, as on every engine), so states are the same as on every
    engine.  Calls become streamed requests (vLLM batches concurrent ones and shares prompts
    through its prefix cache); constraints run inside the server.

    Parameters
    ----------
    url : str
        The server, e.g. ``"http://127.0.0.1:8000"``, or ``"https://..."`` (a server or a
        proxy terminating TLS).
    tokenizer : transformers tokenizer or None
        The served model's tokenizer; None reads it from the served folder.  One whose
        vocabulary differs from the one the server's plugin constrains with is refused
        (`seqstate.ModelMismatch`).
    model : str or None
        Which served model (None: the only one).
    timeout : float
        Seconds to wait for the next streamed token before the call fails.
    name : str or None
        The model's name in messages and ``repr`` (None: the served model's id).
    api_key : str or None
        The key the server checks (``serve --api-key``); None: ``$SEQSTATE_VLLM_API_KEY``
        where it is set.  A server that refuses it, or wants one and got none, raises
        `seqstate.AuthenticationError` here, before any generation.
    ca_certs : str or None
        A PEM file of the certificates an ``https://`` server is checked against (a
        self-signed one, or a private authority's); None: the system's.
    """

    def __init__(self, url: str, tokenizer: Any = None, *, model: str | None = None,
                 timeout: float = 600.0, name: str | None = None, api_key: str | None = None,
                 ca_certs: str | os.PathLike | None = None) -> None:
        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV) or None
        client = Client(url, api_key=api_key, ca_certs=ca_certs, timeout=timeout)
        served = _served(client, model)
        # the served folder, where the server says where (never this process's working directory)
        folder = Path(served["root"]) if served.get("root") else None
        if tokenizer is None:
            tokenizer = _tokenizer(folder, served["id"])
        super().__init__(tokenizer, name or served["id"])
        self.url = client.url
        self.folder = folder if folder is not None and folder.is_dir() else None
        table = vocabulary_table(self.vocab, self.eos_token_ids)
        mine = fingerprint(table)
        theirs = self.folder / VOCAB_FILE if self.folder is not None else None
        if theirs is not None and theirs.is_file() and fingerprint(json.loads(theirs.read_text())) != mine:
            raise ModelMismatch(f"the tokenizer given differs from the one the server at "
                                f"{self.url} constrains with ({theirs}); pass the served "
                                "model's tokenizer")
        context = int(served.get("max_model_len") or 2048)
        self.backend = VllmBackend(client, served["id"], self.vocab.size, mine, context,
                                   signal_tokens(table))

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """The served model's EOS ids, as the server's plugin has them (`served_eos`)."""
        return frozenset(served_eos(self.hf_tokenizer, self.folder))


def _served(client: Client, model: str | None) -> dict[str, Any]:
    """The ``/v1/models`` entry of the model to use: ``model``, or the only one served."""
    served = client.get("/v1/models").get("data", [])
    if not served:
        raise ModelNotAvailable(
            f"the server at {client.url} serves no model (its /v1/models list is empty); "
            "connect to a vLLM server that serves one, such as `python -m seqstate.vllm serve "
            "[--model DIR]` starts")
    listed = ", ".join(repr(e.get("id")) for e in served)
    entries = [e for e in served if model is None or e.get("id") == model]
    if not entries:
        raise ArgumentError(f"the server at {client.url} serves no model {model!r}; it serves "
                            f"{listed}: pass one of them as model=")
    if len(entries) > 1:
        raise ArgumentError(f"the server at {client.url} serves {len(entries)} models "
                            f"({listed}); pass model= with one of them")
    return entries[0]


def _tokenizer(folder: Path | None, served: str) -> Any:
    from transformers import AutoTokenizer

    if folder is None or not (folder / "tokenizer_config.json").is_file():
        where = "in a folder the server does not name" if folder is None else f"in {folder}"
        raise ModelNotAvailable(
            f"the served model {served!r} lives {where}, which is not on this machine; "
            "pass tokenizer= (the served model's transformers tokenizer)")
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
