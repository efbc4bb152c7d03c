"""A model served by vLLM (the ``vllm`` engine): the same states and generators, on a server."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from seqstate.backends.vllm import metrics
from seqstate.backends.vllm.backend import VllmBackend
from seqstate.backends.vllm.client import Client, ServerDown
from seqstate.backends.vllm.pool import SESSION_HEADER, Pool, Replica, ReplicaInfo
from seqstate.backends.vllm.routing import BLOCK
from seqstate.backends.vllm.vocab import served_eos, signal_tokens, vocabulary_table
from seqstate.backends.vllm.wire import VOCAB_FILE, fingerprint
from seqstate.errors import ArgumentError, EngineError, ModelMismatch, ModelNotAvailable
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

    Given several URLs, it is one model over a pool of replicas serving the same weights
    (`seqstate.backends.vllm.pool`): each request goes where its prefix lives, a new root to
    its home replica (or the least loaded, past a threshold), and a replica that fails is
    left for the others until it answers again.  ``model.replicas`` says how each is doing.

    Parameters
    ----------
    url : str or sequence of str
        The server, e.g. ``"http://127.0.0.1:8000"``, or ``"https://..."`` (a server or a
        proxy terminating TLS); or the servers of a pool, each with the same options.  A
        replica that does not answer now is counted down, not refused, while one answers.
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
    data_parallel_size : int or None
        Engines behind each URL (vLLM's ``--data-parallel-size``): each lineage is pinned to
        one engine with the ``X-data-parallel-rank`` header, so it finds its prefix cached
        there.  None: as many as the server's ``/metrics`` names; 1: no pinning (vLLM
        balances on its queues alone).
    spill : int or None
        How many more requests in flight than the least-loaded replica a new root's home
        may carry before the root goes to the least-loaded one (None: `routing.SPILL`).
    session_header : str or None
        The header each request's lineage key goes in (`routing.Sessions`): a router in
        front of replicas hashes it to keep a state's lineage on one of them.  The default,
        ``X-Session-ID``, is vllm-router's; None sends none.
    """

    def __init__(self, url: str | Sequence[str], tokenizer: Any = None, *,
                 model: str | None = None, timeout: float = 600.0, name: str | None = None,
                 api_key: str | None = None, ca_certs: str | os.PathLike | None = None,
                 data_parallel_size: int | None = None, spill: int | None = None,
                 session_header: str | None = SESSION_HEADER) -> None:
        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV) or None
        urls = [url] if isinstance(url, str) else list(url)
        if not urls or not all(isinstance(u, str) for u in urls):
            raise ArgumentError(f"a vLLM model takes a server's URL or a list of them, got "
                                f"{url!r}")
        if data_parallel_size is not None and int(data_parallel_size) < 1:
            raise ArgumentError(f"data_parallel_size is a count of engines (1 or more, or None "
                                f"to read it from the server), got {data_parallel_size!r}")
        clients = [Client(u, api_key=api_key, ca_certs=ca_certs, timeout=timeout) for u in urls]
        if session_header is not None and not (isinstance(session_header, str)
                                               and session_header.isascii()
                                               and session_header.replace("-", "").isalnum()):
            raise ArgumentError(f"session_header is an HTTP header's name (letters, digits "
                                f"and '-', such as 'X-Session-ID') or None, got "
                                f"{session_header!r}")
        served, pool = _pool(clients, model, data_parallel_size, spill, session_header)
        # the served folder, where the server says where (never this process's working directory)
        folder = Path(served["root"]) if served.get("root") else None
        if tokenizer is None:
            tokenizer = _tokenizer(folder, served["id"])
        super().__init__(tokenizer, name or served["id"])
        self.url = clients[0].url
        self.folder = folder if folder is not None and folder.is_dir() else None
        table = vocabulary_table(self.vocab, self.eos_token_ids)
        mine = fingerprint(table)
        theirs = self.folder / VOCAB_FILE if self.folder is not None else None
        if theirs is not None and theirs.is_file() and fingerprint(json.loads(theirs.read_text())) != mine:
            raise ModelMismatch(f"the tokenizer given differs from the one the server at "
                                f"{self.url} constrains with ({theirs}); pass the served "
                                "model's tokenizer")
        context = int(served.get("max_model_len") or 2048)
        self.backend = VllmBackend(pool, served["id"], self.vocab.size, mine, context,
                                   signal_tokens(table))

    @property
    def replicas(self) -> list[ReplicaInfo]:
        """Each replica's url, data-parallel rank, health (``"up"``/``"down"``; a down one
        whose probe is due is probed first), load (this client's requests in flight) and
        requests served, in the order given."""
        return self.backend.pool.info()

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """The served model's EOS ids, as the server's plugin has them (`served_eos`)."""
        return frozenset(served_eos(self.hf_tokenizer, self.folder))


def _pool(clients: list[Client], model: str | None, data_parallel_size: int | None,
          spill: int | None, header: str | None) -> tuple[dict[str, Any], Pool]:
    """The served model's ``/v1/models`` entry and the pool of replicas behind ``clients``:
    each client's data-parallel ranks (or itself), those that do not answer now counted
    down.  `EngineError` where none answers; `ArgumentError` where two serve different
    models."""
    entries: dict[int, dict[str, Any]] = {}
    down: dict[int, ServerDown] = {}
    for i, client in enumerate(clients):
        try:
            entries[i] = _served(client, model)
        except ServerDown as exc:
            down[i] = exc
    if not entries:
        if len(clients) == 1:
            raise down[0]
        said = "; ".join(f"{clients[i].url}: {exc}" for i, exc in down.items())
        raise EngineError(f"no replica of the pool answers: {said}")
    first = next(iter(entries.values()))
    for i, entry in entries.items():
        length = entry.get("max_model_len")
        if (entry["id"], length) != (first["id"], first.get("max_model_len")):
            raise ArgumentError(
                f"the replicas of a pool serve the same model: {clients[0].url} serves "
                f"{first['id']!r} ({first.get('max_model_len')} tokens), {clients[i].url} "
                f"{entry['id']!r} ({entry.get('max_model_len')} tokens); give the URLs of one "
                "model's servers")
    block, replicas = None, []
    for i, client in enumerate(clients):
        samples = _metrics(client) if i in entries else []
        block = block or metrics.block_size(samples)
        size = data_parallel_size or (metrics.engines(samples) if samples else 1)
        ranks = [None] if size == 1 else list(range(size))
        for rank in ranks:
            replica = Replica(client, rank)
            if i in down:
                replica.health.fail(str(down[i]))
            replicas.append(replica)
    return first, Pool(replicas, block or BLOCK, spill, header)


def _metrics(client: Client) -> list[metrics.Sample]:
    """The server's ``/metrics`` samples ([] where it has none to give)."""
    try:
        return metrics.parse(client.text("/metrics"))
    except EngineError:
        return []


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
