"""Serving with vLLM: ``python -m seqstate.vllm serve`` starts a vLLM server on loopback with
seqstate's plugin (its constraints run inside the server), prints its URL, and stops it on
Ctrl-C.  `seqstate.models.vllm` connects to it.  The server runs in an environment of its own,
built by ``make vllm``.  The launcher lives with the engine, in
`seqstate.backends.vllm.server`; this package is its entry point.
"""

from seqstate.backends.vllm.server import Server, free_port, main, model_folder, server_python

__all__ = ["Server", "main", "model_folder", "server_python", "free_port"]
