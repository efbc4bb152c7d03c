"""Kept states: the cost of continuing 1,000 kept states against 50.

A chained program over a dataset: the first call on every document (~40-token prompts, 8
tokens generated), every state kept, then the second call on each (text appended, 8 more
tokens).  50 kept states fit in the store; 1,000 (~48,000 tokens) do not: on HF the default
1 GiB budget holds ~23,000 tokens of SmolLM2's KV (46 KB each), on llama.cpp 61 sequences
and 4,096 cells, so the least recently used KV goes and is prefilled again.  Per continued state: the time, the
tokens prefilled, of those the tokens prefilled *again* (`recomputed_tokens`), and the
evictions of live KV.
"""

from __future__ import annotations

import time

import seqstate as ss

WORDS = ("the river keeps a record of every storm that crossed the valley, and the old "
         "miller reads it in the silt each spring before the first planting")


def _docs(n: int) -> list[str]:
    return [f"Document {i}: {WORDS}." for i in range(n)]


def _run(model, n: int) -> tuple[float, ss.models.base.Stats]:
    text = ss.text(model)
    model.store.clear()
    kept = ss.run_batch(lambda d: text(d, max_tokens=8), _docs(n), concurrency=16,
                        progress=False, return_exceptions=False)
    before = model.stats
    t0 = time.perf_counter()
    ss.run_batch(lambda s: text(s + " In short,", max_tokens=8), kept, concurrency=16,
                 progress=False, return_exceptions=False)
    return time.perf_counter() - t0, model.stats - before


def rows(model, label: str) -> None:
    results = {n: _run(model, n) for n in (50, 1000)}
    per50 = results[50][0] / 50
    for n, (seconds, used) in results.items():
        per = seconds / n
        print(f"  {label:<10} {n:5d} kept: {per * 1000:7.1f} ms per state "
              f"({per / per50:4.2f}x the 50-state cost), prefill {used.prefill_tokens / n:5.1f} "
              f"tokens per state, of which again {used.recomputed_tokens / n:5.1f}; "
              f"{used.live_evictions} live evictions")


def main(model) -> None:
    print("\n== continuing kept states: 1,000 (do not fit) vs 50 (fit), 8 tokens each")
    rows(model, "hf")
    try:
        fast = ss.models.default(engine="llama.cpp")
    except ss.ModelNotAvailable as exc:
        print(f"  llama.cpp engine unavailable: {exc}")
        return
    rows(fast, "llama.cpp")
