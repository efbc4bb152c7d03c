"""seqstate's constraints inside a vLLM server: a V1 logits processor.

Started by ``python -m seqstate.vllm serve`` as
``--logits-processors seqstate_vllm:SeqStateLogitsProcessor``.  A request opts in with
``vllm_xargs={"seqstate": "<json>"}``, a constraint spec (the keys: `seqstate_vllm.wire`).

The package, by concern:

``wire``
    the names shared with seqstate's client and the vocabulary fingerprint (standard library
    only, so seqstate's tests read it without vLLM).
``table``
    the vocabulary table (every token's exact bytes) the constraints are built over.
``cursors``
    a request's constraint rebuilt from its spec (regex, grammar, healing), its replayed
    tokens, forced, banned and allowed positions, and the EOS rule.
``processor``
    `SeqStateLogitsProcessor`, vLLM's interface: requests joining, leaving and moving in the
    batch, and the mask applied to each step's logits.

This package never imports seqstate: the server's environment has only vLLM's dependencies.
"""

from seqstate_vllm.processor import SeqStateLogitsProcessor
from seqstate_vllm.table import Table
from seqstate_vllm.wire import VOCAB_ENV, fingerprint

__all__ = ["SeqStateLogitsProcessor", "Table", "fingerprint", "VOCAB_ENV"]
