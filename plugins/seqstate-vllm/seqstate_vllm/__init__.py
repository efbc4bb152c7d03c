"""seqstate's constraints inside a vLLM server: a V1 logits processor.

Started by ``python -m seqstate.vllm serve`` as
``--logits-processors seqstate_vllm:SeqStateLogitsProcessor``.  A request opts in with
``vllm_xargs={"seqstate": "<json>"}``, a constraint spec (the keys: `seqstate_vllm.wire`).

The package, by concern:

``wire``
    the names shared with seqstate's client and the vocabulary fingerprint (standard library
    only, so seqstate's tests read it without vLLM).
``spec``
    a request's spec checked at admission (shape, types, sizes; standard library only).
``build``
    regexes and grammars built off the engine's step loop, bounded in time and memory.
``table``
    the vocabulary table (every token's exact bytes) the constraints are built over.
``cursors``
    a request's constraint rebuilt from its spec (regex, grammar, healing), its replayed
    tokens, forced, banned and allowed positions, the EOS rule and the signals that end a
    request whose constraint is not built yet or failed.
``processor``
    `SeqStateLogitsProcessor`, vLLM's interface: specs refused at admission, requests
    joining, leaving and moving in the batch, and every row's mask applied in one operation.

This package never imports seqstate: the server's environment has only vLLM's dependencies.
"""

from seqstate_vllm.processor import SeqStateLogitsProcessor
from seqstate_vllm.table import Table
from seqstate_vllm.wire import VOCAB_ENV, fingerprint

__all__ = ["SeqStateLogitsProcessor", "Table", "fingerprint", "VOCAB_ENV"]
