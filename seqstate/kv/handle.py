"""Moved to `seqstate.radix`; re-exported here until the llama.cpp store moves onto the tree."""

from seqstate.radix import PinnedPrefix

__all__ = ["PinnedPrefix"]
