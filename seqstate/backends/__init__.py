"""Engines behind the generators, all speaking the protocol in `seqstate.backends.base`.

``hf`` is the reference (a transformers model, exact in fp32); ``llamacpp`` runs GGUF files
through llama.cpp with KV shared inside llama.cpp's own sequences.
"""

from seqstate.backends.base import Backend, Batch, Capabilities, Handle
from seqstate.backends.hf import HFBackend

__all__ = ["Backend", "Batch", "Capabilities", "Handle", "HFBackend"]
