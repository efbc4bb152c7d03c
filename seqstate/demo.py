"""The demo program behind ``make demo``: each capability shows up here as it lands."""

from __future__ import annotations

import time

import torch

from seqstate.engine import RowRequest, generate
from seqstate.models.hf import Model
from seqstate.sampling import greedy, multinomial

__all__ = ["run"]


def _timed(label: str, fn):
    t0 = time.perf_counter()
    out = fn()
    print(f"  [{label}: {time.perf_counter() - t0:.2f} s]")
    return out


def run(model: Model) -> None:
    """Print a chained program's output on ``model``."""
    prompt = model.encode("Three facts about the ocean:\n1.")
    first = _timed("generate", lambda: generate(model, [RowRequest(tuple(prompt), 24)], greedy()))[0]
    print("1." + first.text)
    before = model.stats
    tokens = first.tokens + tuple(model.encode("\n2."))
    second = _timed("continue", lambda: generate(model, [RowRequest(tokens, 24)], greedy()))[0]
    d = model.stats - before
    print("2." + second.text)
    print(f"  [continuing prefilled {d.prefill_tokens} tokens, reused {d.cached_tokens_reused}]")
    forks = _timed("fork x3", lambda: generate(model, [RowRequest(second.tokens, 12)] * 3,
                                               multinomial(0.8), torch.Generator().manual_seed(0)))
    for i, f in enumerate(forks):
        print(f"  sample {i}: {f.text!r}")
