"""seqstate's constraints inside a vLLM server: a logits processor for each of vLLM's two model
runners.

Started by ``python -m seqstate.vllm serve`` as
``--logits-processors seqstate_vllm:SeqStateLogitsProcessor`` where vLLM runs its V1 model
runner (a CPU), ``seqstate_vllm:SeqStateLogitsProcessorV2`` where it runs Model Runner V2
(CUDA with Triton).  A request opts in with
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
``core``
    what both interfaces share: specs parsed, builds started and briefly waited for, one
    `Request` per constrained request, every row's mask applied in one operation.
``processor``
    `SeqStateLogitsProcessor`, the V1 interface: requests joining, leaving and moving in the
    batch by index, each with its live output-token list.
``processor_v2``
    `SeqStateLogitsProcessorV2`, the Model Runner V2 interface: requests joining by slot,
    their committed tokens read from the runner's buffer at each step.

This package never imports seqstate: the server's environment has only vLLM's dependencies.
"""

from seqstate_vllm.processor import SeqStateLogitsProcessor
from seqstate_vllm.processor_v2 import SeqStateLogitsProcessorV2
from seqstate_vllm.table import Table
from seqstate_vllm.wire import VOCAB_ENV, fingerprint

__all__ = ["SeqStateLogitsProcessor", "SeqStateLogitsProcessorV2", "Table", "fingerprint",
           "VOCAB_ENV"]
