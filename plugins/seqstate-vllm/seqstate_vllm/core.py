"""What vLLM's two logits-processor interfaces share: the constrained requests and their builds.

vLLM 0.32 has two model runners, each with its own interface for logits processors
(`seqstate_vllm.processor` for V1, `seqstate_vllm.processor_v2` for V2).  They differ in how
a request is named (V1: its index in the batch, moved as the batch is condensed; V2: a slot
it keeps until it ends) and in how its output tokens are seen (V1: the live list itself; V2:
the runner's token buffer, read each step).  Everything else is here, once: a spec parsed,
its build started, the `Request` that follows its tokens, the short wait for new builds, and
every constrained row's mask applied in one operation (`seqstate_vllm.cursors.mask_rows`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, wait
from typing import Any

import torch

from seqstate_vllm.build import Builder
from seqstate_vllm.cursors import Request, mask_rows
from seqstate_vllm.spec import check
from seqstate_vllm.table import table
from seqstate_vllm.wire import GRAMMAR, REGEX, XARGS_KEY

__all__ = ["Constrained", "parse", "GRACE"]

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


class Constrained:
    """The requests that carry a seqstate spec, each a `Request` under the key its runner
    names it by (V1: its batch index; V2: its slot), and the builds of their constraints."""

    def __init__(self) -> None:
        self.requests: dict[int, Request] = {}
        self.builder = Builder()
        self.started: list[Future] = []

    def add(self, key: int, params, output: list[int]) -> bool:
        """A request joining under ``key`` (whatever held the key before is gone), ``output``
        the list its output tokens are (or will be) in; whether it carries a spec."""
        self.requests.pop(key, None)
        try:
            spec = parse(params)
        except ValueError:                 # refused at admission; never here
            log.exception("seqstate spec refused in the engine")
            return False
        if spec is None:
            return False
        kind = next((k for k in (REGEX, GRAMMAR) if k in spec), None)
        build = None if kind is None else self.builder.build(kind, spec[kind])
        if build is not None:
            self.started.append(build)
        self.requests[key] = Request(spec, output, build)
        return True

    def remove(self, key: int) -> None:
        self.requests.pop(key, None)

    def move(self, a: int, b: int, swap: bool) -> None:
        """The request under ``a`` now under ``b``; with ``swap``, ``b``'s under ``a``."""
        first, second = self.requests.pop(a, None), self.requests.pop(b, None)
        if first is not None:
            self.requests[b] = first
        if second is not None and swap:
            self.requests[a] = second

    def settle(self) -> None:
        """Wait briefly for the builds started since the last call: a short wait saves most
        new constraints a round trip (their requests would end pending)."""
        started, self.started = self.started, []
        if started:
            wait(started, timeout=GRACE)

    def apply(self, logits: torch.Tensor, rows: dict[int, Request] | None = None
              ) -> torch.Tensor:
        """``logits`` with every row of ``rows`` (row -> its `Request`; by default the
        requests by key, the key being the row) masked in place."""
        return mask_rows(self.requests if rows is None else rows, logits)
