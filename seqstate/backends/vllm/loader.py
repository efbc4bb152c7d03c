"""Connecting to a vLLM server that runs seqstate's plugin: the ``vllm`` engine."""

from __future__ import annotations

from typing import Any

from seqstate.backends.vllm.model import VllmModel

__all__ = ["vllm"]


def vllm(url: str, *, model: str | None = None, tokenizer: Any = None,
         timeout: float = 600.0, name: str | None = None) -> VllmModel:
    """A model on a vLLM server running seqstate's plugin (start one on loopback with
    ``python -m seqstate.vllm serve``): the ``"vllm"`` engine.

    ``tokenizer`` defaults to the served folder's (when the server runs on this machine);
    ``model`` picks one of several served models.  Features that need the whole
    distribution at every position (custom samplers, ``model.full_logits``) are refused with
    `seqstate.CapabilityError` before any request; hooks see ``event.logits`` as None.
    """
    return VllmModel(url, tokenizer, model=model, timeout=timeout, name=name)
