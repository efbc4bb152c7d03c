"""Live states never exhaust an engine: their KV is a cache, not a lease.

A chained program over a dataset keeps every state of its first call, then continues each.
Under the store's budget (bytes on HF; sequence ids and cells on llama.cpp) the least recently
used KV goes, live or not, and a state whose KV went is prefilled again when continued: no
call fails, the results equal a run with room for everything, memory stays within the
budget, and the cost shows in ``live_evictions`` and ``recomputed_tokens``.
"""

from __future__ import annotations

import pytest

import seqstate as ss
from conftest import request_llamacpp

DOCS = 1000
ROWS = 20            # documents per call: 50 calls keep 1,000 states' rows (fast enough to test)
RUN = dict(concurrency=2, progress=False, return_exceptions=False)   # a failed call fails here


def _docs(n: int) -> list[list[str]]:
    """``n`` short distinct documents (a few tokens each: llama.cpp prefills ~100 tokens/s on
    one thread here), in calls of `ROWS`."""
    docs = [f"Item {i}." for i in range(n)]
    return [docs[k: k + ROWS] for k in range(0, n, ROWS)]


def _first(model, chunks):
    text = ss.text(model)
    return ss.run_batch(lambda docs: text(docs, max_tokens=1), chunks, **RUN)


def _second(model, states):
    text = ss.text(model)
    return ss.run_batch(lambda s: text(s + " Next", max_tokens=1), states, **RUN)


def _ids(states) -> list:
    return [s.token_ids for s in states]


def _verify(model) -> None:
    (model.backend if model.engine == "llama.cpp" else model.store).verify()


def test_a_thousand_kept_states_on_hf_stay_within_the_budget():
    model = ss.models.testing.tiny(kv_budget_bytes=1 << 40)
    per_token = model.num_layers * 2 * model.kv_heads * model.head_dim * 4
    docs = _docs(DOCS)
    roomy = _ids(_second(model, _first(model, docs)))           # nothing evicted
    assert model.stats.evictions == 0
    model.store.clear()
    model.store.budget_bytes = budget = 500 * per_token         # ~1/10 of what they need
    kept = _first(model, docs)
    assert model.store.bytes_cached <= budget
    assert 0 < model.stats.kv_bytes_held <= budget              # live KV: what is left of it
    before = model.stats
    tight = _second(model, kept)
    used = model.stats - before
    assert _ids(tight) == roomy
    assert model.store.bytes_cached <= budget
    assert used.live_evictions > 0
    # what a continuation prefills is the kept state's KV that went, computed again, and
    # the one token of each row no call computed before (the last one generated)
    assert used.prefill_tokens - used.recomputed_tokens == DOCS
    assert used.recomputed_tokens > 0
    _verify(model)


@pytest.mark.llamacpp
def test_a_thousand_kept_states_on_llamacpp_never_fail():
    request_llamacpp()
    # 61 usable sequences and 1,024 cells: a few percent of what 1,000 kept states need
    model = ss.models.default(engine="llama.cpp", n_ctx=1024, n_seq_max=64, n_threads=1)
    docs = _docs(DOCS)
    kept = _first(model, docs)
    _verify(model)
    before = model.stats
    tight = _second(model, kept)
    used = model.stats - before
    assert used.live_evictions > 0 and used.recomputed_tokens > 0
    assert used.prefill_tokens - used.recomputed_tokens == DOCS     # as on HF
    _verify(model)
    # the same program continuing each state at once, on a sample (llama.cpp's results do
    # not depend on what is cached or batched: bit for bit)
    text = ss.text(model)
    sample = docs[::10]
    at_once = ss.run_batch(lambda d: text(text(d, max_tokens=1) + " Next", max_tokens=1),
                           sample, **RUN)
    assert _ids(at_once) == _ids(tight[::10])
    _verify(model)


@pytest.mark.llamacpp
def test_two_kept_states_on_a_small_llamacpp_cache_continue_in_any_order():
    request_llamacpp()
    model = ss.models.default(engine="llama.cpp", n_ctx=512, n_seq_max=4, n_threads=1)
    text = ss.text(model)
    a = text("The first story begins", max_tokens=4)
    b = text("A second, different tale starts", max_tokens=4)
    _verify(model)
    outs = {}
    for name, s in [("a", a), ("b", b), ("a2", a), ("b2", b)]:   # each evicts the other
        outs[name] = text(s + " Next,", max_tokens=4)
        _verify(model)
    assert outs["a"].token_ids == outs["a2"].token_ids
    assert outs["b"].token_ids == outs["b2"].token_ids
    assert model.stats.live_evictions > 0
    fresh = ss.models.default(engine="llama.cpp", n_ctx=512, n_seq_max=4, n_threads=1)
    alone = ss.text(fresh)(ss.text(fresh)("A second, different tale starts", max_tokens=4)
                           + " Next,", max_tokens=4)
    assert alone.token_ids == outs["b"].token_ids
