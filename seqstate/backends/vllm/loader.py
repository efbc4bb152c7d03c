"""Connecting to a vLLM server that runs seqstate's plugin: the ``vllm`` engine."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from seqstate.backends.vllm.model import VllmModel
from seqstate.backends.vllm.pool import SESSION_HEADER

__all__ = ["vllm"]


def vllm(url: str | Sequence[str], *, model: str | None = None, tokenizer: Any = None,
         timeout: float = 600.0, name: str | None = None, api_key: str | None = None,
         ca_certs: str | os.PathLike | None = None, data_parallel_size: int | None = None,
         spill: int | None = None, session_header: str | None = SESSION_HEADER) -> VllmModel:
    """A model on a vLLM server running seqstate's plugin (start one on loopback with
    ``python -m seqstate.vllm serve``): the ``"vllm"`` engine.

    ``tokenizer`` defaults to the served folder's (when the server runs on this machine);
    ``model`` picks one of several served models.  ``api_key`` (default
    ``$SEQSTATE_VLLM_API_KEY``) is the key a server started with ``--api-key`` checks; a
    missing or wrong one raises `seqstate.AuthenticationError` here, before any generation.
    ``https://`` URLs are checked against the system's certificates, or ``ca_certs`` (a PEM
    file, such as a proxy's self-signed certificate).  Features that need the whole
    distribution at every position (custom samplers, ``model.full_logits``) are refused with
    `seqstate.CapabilityError` before any request; hooks see ``event.logits`` as None.

    A list of URLs is one model over a pool of replicas of the same weights (each with the
    same ``api_key``, ``tokenizer`` and ``ca_certs``): requests go where their prefix is
    cached, a failed replica's requests are sent again to another with the same results, and
    `seqstate.EngineError` comes only when no replica can serve.  ``model.replicas``
    reports each one.  ``data_parallel_size`` pins each lineage to one engine of a server
    started with vLLM's ``--data-parallel-size`` (None: read from the server); ``spill`` is
    the pool's load threshold for new roots (`VllmModel`).

    Every request carries a lineage key in the header ``session_header`` (None: none): one
    value for a state's whole lineage, so a router in front of replicas (vllm-router's
    ``consistent_hash`` reads ``X-Session-ID``) keeps it on one replica.  Through one URL, a
    request cut by a failure is sent again after a short wait, a few times.
    """
    return VllmModel(url, tokenizer, model=model, timeout=timeout, name=name, api_key=api_key,
                     ca_certs=ca_certs, data_parallel_size=data_parallel_size, spill=spill,
                     session_header=session_header)
