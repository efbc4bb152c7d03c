"""The Hugging Face engine: the reference backend, exact against a fresh fp32 forward.

Everything the engine is lives here: the network forward and the backend (`backend`), its KV
store of torch segments on the shared radix tree (`store`), prefill (`prefill`), the in-place
decode buffer (`buffer`), the working rows over it (`batch`) and the only module that speaks
transformers' ``Cache`` API (`cache`).
"""

from seqstate.backends.hf.backend import HFBackend
from seqstate.backends.hf.batch import HFBatch
from seqstate.backends.hf.buffer import KVBuffer
from seqstate.backends.hf.store import DEFAULT_BUDGET_BYTES, KVHandle, KVStore, Segment

__all__ = ["HFBackend", "HFBatch", "KVBuffer", "KVStore", "KVHandle", "Segment",
           "DEFAULT_BUDGET_BYTES"]
