"""The engine: greedy equals HF generate; KV through the store equals a fresh forward."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqstate.engine import Decoding, RowRequest, generate, next_logprobs
from seqstate.sampling import multinomial

from conftest import assert_close, hf_generate

PROMPTS = ["Q: name three vehicles.\nA:", "Hello", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"]


def check_greedy_matches_hf(model, n):
    ids = [model.encode(p) for p in PROMPTS]
    single = [generate(model, [RowRequest(tuple(i), n)])[0] for i in ids]
    batched = generate(model, [RowRequest(tuple(i), n) for i in ids])
    for i, a, b in zip(ids, single, batched):
        expected = hf_generate(model, i, n)
        assert list(a.tokens[a.start:]) == expected
        assert list(b.tokens[b.start:]) == expected


def test_greedy_matches_hf_generate_tiny(tiny):
    check_greedy_matches_hf(tiny, 24)


@pytest.mark.real
def test_greedy_matches_hf_generate_real(real):
    check_greedy_matches_hf(real, 24)


def assert_close_to_fresh(model, rows):
    got = next_logprobs(model, rows)
    for r, g in zip(rows, got):
        ref = model.full_logits(list(r))[-1].log_softmax(-1)
        assert_close(g, ref, model, "logits through the store vs a fresh forward", cap=1e-3)


def test_logits_through_reused_sliced_forked_and_batched_kv(fresh_tiny):
    m = fresh_tiny
    base = m.encode("The quick brown fox jumps over the lazy dog. " * 3)
    res = generate(m, [RowRequest(tuple(base), 12)] * 3,
                   Decoding(multinomial(), torch.Generator().manual_seed(0)))
    rows = [list(r.tokens) for r in res]
    assert_close_to_fresh(m, rows)                                  # reused, forked
    assert_close_to_fresh(m, [r[:len(base) - 5] for r in rows])     # sliced back into the prompt
    assert_close_to_fresh(m, [r[: len(base) + 4] for r in rows] + [base[:7], m.encode("Other")])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["extend", "crop", "fork", "batch"]),
                          st.integers(0, 10_000)), min_size=1, max_size=6))
def test_random_extend_crop_fork_batch_is_exact(tiny, ops):
    vocab = 300
    rows = [tiny.encode("Once upon a time")]
    for op, arg in ops:
        r = rows[arg % len(rows)]
        if op == "extend":
            rows.append(r + [(arg * 7 + i) % vocab + 100 for i in range(arg % 9 + 1)])
        elif op == "crop" and len(r) > 1:
            rows.append(r[: 1 + arg % (len(r) - 1)])
        elif op == "fork":
            res = generate(tiny, [RowRequest(tuple(r), 3)] * 2,
                           Decoding(multinomial(), torch.Generator().manual_seed(arg)))
            rows.extend(list(x.tokens) for x in res)
        else:
            rows = rows[-4:]
    assert_close_to_fresh(tiny, rows[-4:])


def test_continuing_prefills_only_new_tokens(fresh_tiny):
    m = fresh_tiny
    first = generate(m, [RowRequest(tuple(m.encode("A long enough prompt for this")), 8)])[0]
    before = m.stats
    appended = m.encode(" and then")
    generate(m, [RowRequest(first.tokens + tuple(appended), 4)])
    d = m.stats - before
    # the last generated token (never fed) plus the appended text minus its last token,
    # which the first decode step feeds
    assert d.prefill_tokens == 1 + len(appended) - 1
    assert d.cached_tokens_reused == len(first.tokens) - 1


def test_shared_prefix_is_prefilled_once(fresh_tiny):
    m = fresh_tiny
    system = m.encode("You are a helpful assistant. Answer briefly and precisely. " * 4)
    words = ["apple", "river", "stone", "cloud", "tiger", "paper", "music", "glass", "bread", "train",
             "horse", "light", "chair", "ocean", "green", "sugar", "metal", "field", "dream", "smile"]
    questions = [m.encode(f" {w.title()}: what rhymes with {w}?") for w in words]
    assert len({q[0] for q in questions}) == 20, "questions must diverge right after the prefix"
    before = m.stats
    generate(m, [RowRequest(tuple(system + q), 2) for q in questions])
    d = m.stats - before
    tails = sum(len(q) - 1 for q in questions)
    assert d.prefill_tokens == len(system) + tails


def test_fork_memory_is_prompt_plus_suffixes(fresh_tiny):
    m = fresh_tiny
    prompt = [100 + (i * 37) % 5000 for i in range(512)]
    before = m.stats
    res = generate(m, [RowRequest(tuple(prompt), 32)] * 8,
                   Decoding(multinomial(), torch.Generator().manual_seed(1)))
    d = m.stats - before
    assert d.prefill_tokens == 511                                   # the prompt, once
    per_token = m.num_layers * 2 * m.kv_heads * m.head_dim * 4
    assert m.stats.kv_bytes_cached <= (512 + 8 * 32) * per_token
    assert len({r.tokens for r in res}) > 1


def test_a_kept_state_is_a_cache_not_a_lease(fresh_tiny):
    """Under the budget a live state's KV goes like any other, least recently used first;
    continuing the state computes it again, counted, with the result it had with room."""
    m = fresh_tiny
    per_token = m.num_layers * 2 * m.kv_heads * m.head_dim * 4
    m.store.budget_bytes = 200 * per_token
    kept = generate(m, [RowRequest(tuple(m.encode("kept " * 60)), 8)])[0]
    assert m.stats.kv_bytes_held == len(kept.tokens[:-1]) * per_token    # live, stored
    for i in range(10):
        generate(m, [RowRequest(tuple(m.encode(f"filler {i} " * 30)), 4)])
        assert m.store.bytes_cached <= m.store.budget_bytes        # nothing exceeds it
    assert m.stats.live_evictions > 0 and not kept.handle.stored
    m.store.verify()
    before = m.stats
    again = generate(m, [RowRequest(kept.tokens, 8)])[0]
    used = m.stats - before
    assert used.recomputed_tokens == len(kept.tokens) - 1 == used.prefill_tokens
    m.store.clear()
    m.store.budget_bytes = 1 << 40                                  # room for everything
    alone = generate(m, [RowRequest(kept.tokens, 8)])[0]
    assert again.tokens == alone.tokens
    assert_close_to_fresh(m, [list(again.tokens)])
    m.store.verify()


def test_finished_rows_stop_costing_compute(fresh_tiny):
    m = fresh_tiny
    p = tuple(m.encode("Count:"))
    before = m.stats
    generate(m, [RowRequest(p, 1), RowRequest(p, 1), RowRequest(p, 1), RowRequest(p, 20)])
    assert (m.stats - before).decode_tokens == 3 + 20


def test_stop_string_across_tokens(tiny):
    p = tuple(tiny.encode("x"))
    free = generate(tiny, [RowRequest(p, 12)])[0]
    text = free.text
    stop = text[3:6]
    from seqstate.detokenize import StopMatcher

    res = generate(tiny, [RowRequest(p, 12, stop=StopMatcher([stop]))])[0]
    assert res.finish_reason == "stop"
    assert res.text == text[: text.index(stop)]
    assert tiny.vocab.decode(res.tokens[res.start:]) == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize("free", [64, 1])
def test_the_worker_runs_on_the_free_cpus_and_the_caller_keeps_its_threads(fresh_tiny,
                                                                           monkeypatch, free):
    """The scheduler's worker sets its thread policy once, as it starts: torch's threads,
    cut to the CPUs no other process runs on; every forward it runs uses that many, and the
    calling thread's own threads stay as they were."""
    import seqstate as ss
    from seqstate.backends.hf import backend

    monkeypatch.setattr(backend, "free_cpus", lambda: free)
    seen = []                         # torch's threads inside each forward
    hook = fresh_tiny.hf_model.register_forward_pre_hook(
        lambda module, args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        with fresh_tiny.frozen_store():                   # a hooked model stores nothing
            ss.text(fresh_tiny)(["Hi there", "A longer prompt " * 40], max_tokens=3)
    finally:
        hook.remove()
    assert seen and set(seen) == {min(before, free)}
    assert torch.get_num_threads() == before


def test_free_cpus_discounts_other_processes_running(monkeypatch):
    """Two spinning processes beside this one on its CPUs leave it fewer free (at least 1)."""
    import os
    import subprocess
    import sys
    import time

    from seqstate.backends.base import free_cpus

    cpus = len(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        seen = min(free_cpus() for _ in range(20))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert 1 <= seen <= max(1, cpus - 2)


def test_work_counters_are_declared_once(tiny):
    """The backend's counters and the model's stats take their names from `WorkCounters`."""
    import dataclasses

    from seqstate.backends.base import WorkCounters
    from seqstate.models.base import Stats

    names = [f.name for f in dataclasses.fields(WorkCounters)]
    assert list(tiny.backend.counters) == names
    assert issubclass(Stats, WorkCounters)
    assert set(names) < set(dataclasses.asdict(tiny.stats))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["step", "draft", "drop", "drop_all"]),
                          st.integers(0, 10_000)), min_size=1, max_size=10),
       st.integers(1, 3))
def test_hf_batch_feeds_drafts_and_truncations_are_exact(tiny, ops, n):
    """Random forwards, multi-column feeds and truncations of 1-3 rows of the HF engine's
    batch: every fed row's logits equal a fresh forward of its tokens.  After every forward
    the buffer ends where its longest row does (columns every row dropped are written again),
    and one row never needs a mask (one made each later forward ~20% slower)."""

    def check_the_buffer():
        rows_ = [batch.row_of[s] for s in slots]      # a row's end: past its last column
        ends = [batch.cols[r][-1] + 1 if batch.cols[r] else batch.first[r] + batch.bases[r].length
                for r in rows_]
        assert batch.buf.length == max(ends)
        assert n > 1 or not batch.padded

    rows = [tiny.encode("Once upon a time") + [100 + j] * j for j in range(n)]
    fed = [0] * n                      # columns fed past each row's stored prefix
    batch = tiny.backend.batch()
    slots = batch.add(rows, grow_by=4)   # the KV of each row but its last token
    try:
        for op, arg in ops:
            if op in ("step", "draft"):
                extra = [[(arg + 7 * j + i) % 300 + 100 for i in range((arg + j) % 3)]
                         if op == "draft" else [] for j in range(n)]
                got = batch.extend(slots, [[r[-1]] + e for r, e in zip(rows, extra)])
                for j, e in enumerate(extra):
                    rows[j] += e
                    fed[j] += 1 + len(e)
                    assert_close(got[j], tiny.full_logits(rows[j])[-1 - len(e):], tiny, op)
                    rows[j].append((arg + j) % 300 + 100)
                check_the_buffer()
                continue
            d = 1 + arg % 3
            drop = [j for j in range(n) if (op == "drop_all" or j == arg % n) and fed[j] >= d]
            for j in drop:
                kept = batch.length(slots[j]) - d
                batch.truncate(slots[j], kept)
                del rows[j][kept + 1:]            # the token after the kept KV: fed next
                fed[j] -= d
        assert [batch.length(s) for s in slots] == [len(r) - 1 for r in rows]
    finally:
        batch.close()
