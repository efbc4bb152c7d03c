"""Moved: the radix tree under every engine's store is `seqstate.radix`, the HF engine's store,
buffers and ``Cache`` adapter are in `seqstate.backends.hf`, the llama.cpp engine's store in
`seqstate.backends.llamacpp.store`."""

__all__: list[str] = []
