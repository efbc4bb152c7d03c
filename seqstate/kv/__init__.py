"""KV storage: the radix store of immutable segments and the decode buffers."""

from seqstate.kv.buffer import KVBuffer
from seqstate.kv.store import DEFAULT_BUDGET_BYTES, KVHandle, KVStore, Segment

__all__ = ["KVStore", "KVHandle", "Segment", "KVBuffer", "DEFAULT_BUDGET_BYTES"]
