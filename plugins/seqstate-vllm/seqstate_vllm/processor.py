"""The logits processor for vLLM's V1 model runner: one `Request` per batch index that carries
a seqstate spec (`seqstate_vllm.core.Constrained`).

vLLM calls ``validate_params`` in its API server, before a request reaches the engine: a spec
of the wrong shape or over the bounds (`seqstate_vllm.spec`) is refused there with HTTP 400.
In the engine, ``update_state`` only starts a constraint's build (`seqstate_vllm.build`); a
request whose build is not done yet is ended with its pending signal at its first step (its
client sends it again), so no build ever holds up the step loop.  ``apply`` masks every
constrained row in one operation on the logits' device.  V1 hands the processor each
request's live output-token list, which its `Request` follows.
"""

from __future__ import annotations

import torch

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from seqstate_vllm.core import Constrained, parse

__all__ = ["SeqStateLogitsProcessor"]


class SeqStateLogitsProcessor(LogitsProcessor):
    """The V1 logits processor: the constrained requests by batch index."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        parse(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.constrained = Constrained()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.constrained.remove(index)
        for index, params, _prompt, output in batch_update.added:
            self.constrained.add(index, params, output)
        for a, b, direction in batch_update.moved:
            self.constrained.move(a, b, direction == MoveDirectionality.SWAP)
        self.constrained.settle()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.constrained.apply(logits)
