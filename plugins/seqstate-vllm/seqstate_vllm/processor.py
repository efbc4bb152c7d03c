"""The logits processor: vLLM V1's interface, one `Request` per batch index that carries a
seqstate spec."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from seqstate_vllm.cursors import Request
from seqstate_vllm.table import table
from seqstate_vllm.wire import CONSTRAINTS, KEYS, VOCAB_KEY, XARGS_KEY

__all__ = ["SeqStateLogitsProcessor", "parse"]

log = logging.getLogger("seqstate_vllm")


def parse(params) -> dict[str, Any] | None:
    """The request's seqstate spec (from its ``SamplingParams.extra_args``), checked; None
    where it has none."""
    extra = getattr(params, "extra_args", None) or {}
    raw = extra.get(XARGS_KEY)
    if raw is None:
        return None
    spec = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(spec, dict) or not set(spec) <= KEYS:
        raise ValueError(f"seqstate spec must be an object with keys from {sorted(KEYS)}")
    if sum(k in spec for k in CONSTRAINTS) > 1:
        raise ValueError(f"a seqstate spec has at most one of {', '.join(CONSTRAINTS)}")
    if spec.get(VOCAB_KEY) != table().fingerprint:
        raise ValueError("seqstate vocabulary mismatch: the client's tokenizer differs from the "
                         "one this server was started with (fingerprint "
                         f"{str(spec.get(VOCAB_KEY))[:12]} vs {table().fingerprint[:12]})")
    return spec


class SeqStateLogitsProcessor(LogitsProcessor):
    """The V1 logits processor: one `Request` per batch index that carries a seqstate spec."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        parse(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.requests: dict[int, Request] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.requests.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            spec = parse(params)
            if spec is None:
                self.requests.pop(index, None)
            else:
                self.requests[index] = Request(spec, output)
        for a, b, direction in batch_update.moved:
            first, second = self.requests.pop(a, None), self.requests.pop(b, None)
            if first is not None:
                self.requests[b] = first
            if second is not None and direction == MoveDirectionality.SWAP:
                self.requests[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, request in self.requests.items():
            try:
                request.apply(logits[index])
            except Exception:
                log.exception("seqstate constraint failed; the request ends here")
                request.dead = True
                logits[index].fill_(float("-inf"))
                logits[index, table().eos] = 0.0
        return logits
