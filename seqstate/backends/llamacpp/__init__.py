"""The llama.cpp engine: GGUF models, KV shared token by token inside llama.cpp.

Needs ``llama-cpp-python`` (it compiles llama.cpp; ``make test`` installs it).  Importing this
package imports no llama.cpp: `loader` and `model` import without it and refuse to build a
model with `seqstate.ModelNotAvailable` saying how to install it; `backend`, `batch`, `store`
and `native` need it.
"""
