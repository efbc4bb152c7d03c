"""The logits processor: vLLM V1's interface, one `Request` per batch index that carries a
seqstate spec.

vLLM calls ``validate_params`` in its API server, before a request reaches the engine: a spec
of the wrong shape or over the bounds (`seqstate_vllm.spec`) is refused there with HTTP 400.
In the engine, ``update_state`` only starts a constraint's build (`seqstate_vllm.build`); a
request whose build is not done yet is ended with its pending signal at its first step (its
client sends it again), so no build ever holds up the step loop.  ``apply`` masks every
constrained row in one operation on the logits' device.
"""

from __future__ import annotations

import logging
from concurrent.futures import wait
from typing import Any

import torch

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from seqstate_vllm.build import Builder
from seqstate_vllm.cursors import Request, mask_rows
from seqstate_vllm.spec import check
from seqstate_vllm.table import table
from seqstate_vllm.wire import GRAMMAR, REGEX, XARGS_KEY

__all__ = ["SeqStateLogitsProcessor", "parse", "GRACE"]

GRACE = 0.02     # seconds one step may wait for new requests' builds (most take less)

log = logging.getLogger("seqstate_vllm")


def parse(params) -> dict[str, Any] | None:
    """The request's seqstate spec (from its ``SamplingParams.extra_args``), checked
    (`seqstate_vllm.spec.check`); None where it has none."""
    extra = getattr(params, "extra_args", None) or {}
    raw = extra.get(XARGS_KEY)
    if raw is None:
        return None
    t = table()
    return check(raw, t.fingerprint, t.size)


class SeqStateLogitsProcessor(LogitsProcessor):
    """The V1 logits processor: one `Request` per batch index that carries a seqstate spec."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        parse(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.requests: dict[int, Request] = {}
        self.builder = Builder()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.requests.pop(index, None)
        started = []
        for index, params, _prompt, output in batch_update.added:
            self.requests.pop(index, None)
            try:
                spec = parse(params)
            except ValueError:                 # refused at admission; never here
                log.exception("seqstate spec refused in the engine")
                continue
            if spec is None:
                continue
            kind = next((k for k in (REGEX, GRAMMAR) if k in spec), None)
            build = None if kind is None else self.builder.build(kind, spec[kind])
            if build is not None:
                started.append(build)
            self.requests[index] = Request(spec, output, build)
        for a, b, direction in batch_update.moved:
            first, second = self.requests.pop(a, None), self.requests.pop(b, None)
            if first is not None:
                self.requests[b] = first
            if second is not None and direction == MoveDirectionality.SWAP:
                self.requests[a] = second
        if started:               # a short wait saves most new constraints a round trip
            wait(started, timeout=GRACE)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return mask_rows(self.requests, logits)
