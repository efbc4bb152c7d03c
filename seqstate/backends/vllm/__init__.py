"""The ``vllm`` engine: a vLLM server with seqstate's plugin, over HTTP
(`seqstate.backends.vllm.backend`); the vocabulary table client and plugin agree on
(`seqstate.backends.vllm.vocab`)."""

from seqstate.backends.vllm.backend import RemoteHandle, VllmBackend
from seqstate.backends.vllm.client import Client

__all__ = ["VllmBackend", "RemoteHandle", "Client"]
