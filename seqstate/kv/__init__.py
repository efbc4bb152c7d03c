"""Moved: the radix tree is `seqstate.radix`, the HF engine's store, buffers and ``Cache``
adapter are in `seqstate.backends.hf`.  Only `seqstate.kv.handle` remains, for the llama.cpp
store until it moves onto `seqstate.radix`."""

__all__: list[str] = []
