"""The llama.cpp engine: GGUF models, KV shared token by token inside llama.cpp.

Needs ``llama-cpp-python`` (it compiles llama.cpp; ``make test`` installs it).
"""

from seqstate.backends.llamacpp.backend import NOISE_FLOOR, LlamaCppBackend, check_options
from seqstate.backends.llamacpp.batch import LlamaCppBatch
from seqstate.backends.llamacpp.native import check_gguf
from seqstate.backends.llamacpp.store import SeqHandle, SeqStore

__all__ = ["LlamaCppBackend", "LlamaCppBatch", "SeqStore", "SeqHandle", "NOISE_FLOOR",
           "check_options", "check_gguf"]
