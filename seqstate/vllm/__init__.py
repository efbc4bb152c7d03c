"""Serving with vLLM: ``python -m seqstate.vllm serve`` starts a vLLM server with seqstate's
plugin (its constraints run inside the server), prints its URL, and stops it on Ctrl-C.
`seqstate.models.vllm` connects to it.  The server runs in an environment of its own, built
by ``make vllm`` (or any with vLLM and the plugin, on a GPU host).  The launcher lives with
the engine, in `seqstate.backends.vllm.server` and `seqstate.backends.vllm.serve`; this
package is its entry point.  ``python -m seqstate.vllm router URL ...`` starts vllm-router in
front of servers (`Router`, `seqstate.backends.vllm.gateway`).
"""

from seqstate.backends.vllm.gateway import Router
from seqstate.backends.vllm.serve import main
from seqstate.backends.vllm.server import Server, free_port, model_folder, server_python

__all__ = ["Server", "Router", "main", "model_folder", "server_python", "free_port"]
