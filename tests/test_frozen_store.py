"""`model.frozen_store()` and the hook guard: activation hooks never poison the store.

Inside a block, stored KV is read and nothing is written: what calls compute is scratch (no
later call matches it, it goes with the last state holding it), so the store is the same,
node for node and byte for byte, before and after.  Outside a block, the HF engine refuses a
model with torch forward hooks before any compute.  References are independent: the HF model
run by hand over the whole sequence, with no cache, with the same hook.
"""

import gc
import threading

import pytest
import torch
from torch.nn.modules import module as torch_module

import seqstate as ss
from seqstate.backends.hf import prefill

from conftest import assert_close

PROMPT = "The quick brown fox jumps over the lazy dog. Then it"


def store_snapshot(model):
    """Every stored node's whole token path -> a copy of its KV, and the store's stats."""
    store = model.store
    gc.collect()
    with store.lock:
        nodes = {}
        for node in store.tree.nodes():
            path, hi, n = [], len(node.tokens), node
            while n.parent is not None:
                path[:0] = n.tokens[:hi]
                hi, n = n.offset, n.parent
            nodes[tuple(path)] = node.kv.clone()
    s = model.stats
    return nodes, (s.kv_bytes_cached, s.segments, s.evictions)


def assert_same_store(before, after):
    assert after[1] == before[1]
    assert after[0].keys() == before[0].keys()
    for path, kv in before[0].items():
        assert torch.equal(after[0][path], kv), f"the KV of a {len(path)}-token path changed"


def steer(model, after: int, scale: float = 20.0, layer: int = 0):
    """A forward hook adding a fixed vector to ``layer``'s output at positions >= ``after``
    (the positions past the stored prefix); returns its handle."""
    gen = torch.Generator().manual_seed(0)
    vector = scale * torch.randn(model.hf_model.config.hidden_size, generator=gen)

    def hook(module, args, kwargs, out):
        hidden = out[0] if isinstance(out, tuple) else out
        where = (kwargs["position_ids"] >= after)[..., None]               # (B, T, 1)
        hidden = hidden + where * vector.to(hidden.dtype)
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    return model.hf_model.model.layers[layer].register_forward_hook(hook, with_kwargs=True)


@torch.inference_mode()
def manual_logits(model, tokens):
    """The HF model by hand over all of ``tokens`` (hooks included), no cache: (T, V)."""
    out = model.hf_model(input_ids=torch.tensor([list(tokens)]), use_cache=False)
    return out.logits[0].float()


def manual_greedy(model, tokens, n):
    tokens = list(tokens)
    for _ in range(n):
        tokens.append(int(manual_logits(model, tokens)[-1].argmax()))
    return tokens


def frozen_logits(model, rows):
    """Next-token logits of ``rows`` through the engine's batch (stored prefixes read)."""
    batch = model.backend.batch()
    try:
        slots = batch.add(rows, 1)
        return batch.forward(slots, [r[-1] for r in rows])
    finally:
        batch.close()


def patching_run(model, tokens, stored, n, **steering):
    """With a steering hook past ``stored`` tokens: the next-token logits and greedy ``n``
    tokens inside ``frozen_store()``, and the same by hand; the hook removed after."""
    hook = steer(model, after=stored, **steering)
    try:
        with model.frozen_store():
            logits = frozen_logits(model, [tokens])[0]
            patched = ss.text(model)(ss.from_tokens(model, [tokens]), max_tokens=n)
        return logits, patched, manual_logits(model, tokens)[-1], manual_greedy(model, tokens, n)
    finally:
        hook.remove()


# -- a patching run equals the hooked model by hand; the store does not change ---------------

def test_a_hooked_patching_run_inside_frozen_store_equals_a_manual_hooked_forward(fresh_tiny):
    model = fresh_tiny
    prefix = ss.text(model)(PROMPT, max_tokens=6)          # stored, clean
    stored = len(prefix.token_ids[0][0])
    variant = prefix + " and the cat"
    tokens = variant.token_ids[0][0]
    clean_next = manual_logits(model, tokens)[-1]
    clean_greedy = manual_greedy(model, tokens, 8)
    before = store_snapshot(model)
    work = model.stats

    logits, patched, expected_next, expected_greedy = patching_run(model, tokens, stored, 8)

    assert (expected_next - clean_next).abs().max() > 0.1                  # the hook matters
    assert expected_greedy != clean_greedy
    assert_close(logits, expected_next, model, "patched logits vs the hooked model by hand",
                 cap=1e-3)
    assert patched.token_ids[0][0] == expected_greedy
    used = model.stats - work
    assert used.cached_tokens_reused >= stored - 1             # the stored prefix was read
    assert used.prefill_tokens <= 2 * (len(tokens) - stored)   # only the tails were computed
    assert model.store.bytes_scratch > 0                       # `patched` pins its KV
    del patched
    assert_same_store(before, store_snapshot(model))
    assert model.store.bytes_scratch == 0 and model.store.tree.scratch_count == 0
    model.store.verify()


def test_scoring_and_next_logprobs_with_hooks_inside_frozen_store(fresh_tiny):
    """`state.score` and `state.next_logprobs` on a hooked model: refused outside, equal to
    the hooked model by hand inside, the store unchanged (even with ``store=True``)."""
    model = fresh_tiny
    prefix = ss.text(model)(PROMPT, max_tokens=3)
    stored = len(prefix.token_ids[0][0]) - 1            # the last token's KV is not stored
    variants = prefix + [" and the cat", " or a dog"]   # two batch items past the prefix
    options = [" sat down", " ran"]
    before = store_snapshot(model)
    hook = steer(model, after=stored)
    try:
        with pytest.raises(ss.ActivationHookError):
            variants.score(options)
        with model.frozen_store():
            scores = variants.score(options, store=True)
            nexts = variants.next_logprobs()
        for b, row in enumerate(variants.token_ids):
            tokens = row[0]
            want_next = manual_logits(model, tokens)[-1].log_softmax(-1)
            assert_close(nexts[b, 0], want_next, model, "hooked next_logprobs vs by hand",
                         cap=1e-3)
            for o, option in enumerate(options):
                ids = model.encode(option)
                full = manual_logits(model, tokens + ids).log_softmax(-1)
                want = [float(full[len(tokens) - 1 + j, t]) for j, t in enumerate(ids)]
                assert_close(scores.logprobs[b][0][o], want, model, "hooked scores vs by hand")
    finally:
        hook.remove()
    hooked = scores.sums
    del scores
    assert_same_store(before, store_snapshot(model))
    assert abs(variants.score(options).sums - hooked).max() > 1e-2     # the hook mattered


def test_frozen_prefill_of_shared_prefixes_and_chunked_tails_stores_nothing(fresh_tiny,
                                                                          monkeypatch):
    """Rows sharing a long uncached prefix (computed once, as scratch, then continued) and
    tails longer than a prefill chunk (continued from a scratch chunk) are exact."""
    model = fresh_tiny
    base = model.encode_prompt(PROMPT)
    ss.text(model)(PROMPT, max_tokens=1)
    shared = base + [200 + i for i in range(30)]
    rows = [shared + [7, 8, 9], model.encode_prompt("Another prompt"), shared + [11, 12],
            shared + [300 + i for i in range(40)]]
    before = store_snapshot(model)
    monkeypatch.setattr(prefill, "PREFILL_CHUNK", 8)
    with model.frozen_store():
        logits = frozen_logits(model, rows)
    for row, got in zip(rows, logits):
        assert_close(got, manual_logits(model, row)[-1], model,
                     "frozen chunked prefill vs a fresh forward", cap=1e-3)
    assert_same_store(before, store_snapshot(model))
    model.store.verify()


def test_kv_fed_inside_a_block_is_scratch_when_committed_after_it(fresh_tiny):
    """A row's columns computed while frozen stay scratch whenever they are committed; cut
    back below them, the row commits clean again."""
    model = fresh_tiny
    row = model.encode_prompt(PROMPT)
    ss.text(model)(PROMPT, max_tokens=1)
    before = store_snapshot(model)
    batch = model.backend.batch()
    [a, b] = batch.add([row, row], 4)
    batch.forward([a], [row[-1]])                             # clean
    with model.frozen_store():
        batch.forward([a, b], [5, row[-1]])                   # a: one more; b: its first
    grown = row + [5]
    handle = batch.commit(a, grown, len(grown))
    assert handle.length == len(grown) and handle.node.scratch
    assert batch.commit(b, row, len(row)).node.scratch
    del handle
    assert_same_store(before, store_snapshot(model))
    batch.truncate(a, len(row))
    clean = batch.commit(a, row, len(row))
    batch.close()
    assert not clean.node.scratch and model.store.match(row).length == len(row)
    model.store.verify()


# -- refused before compute outside a block ----------------------------------------------------

def test_a_hooked_model_is_refused_before_compute_and_works_once_the_hook_is_removed(fresh_tiny):
    model = fresh_tiny
    state = ss.text(model)(PROMPT, max_tokens=3)
    before, work = store_snapshot(model), model.stats
    hook = model.hf_model.model.layers[1].mlp.register_forward_pre_hook(lambda m, args: None)
    try:
        with pytest.raises(ss.ActivationHookError) as caught:
            ss.text(model)(state + " and then", max_tokens=4)
        with pytest.raises(ss.ActivationHookError):
            frozen_logits(model, [state.token_ids[0][0]])     # fully stored: still refused
        reference = model.full_logits(state.token_ids[0][0])  # the reference stores nothing
    finally:
        hook.remove()
    message = str(caught.value)
    assert "model.layers.1.mlp" in message and "frozen_store" in message and "remove" in message
    assert caught.value.hooks == {"model.layers.1.mlp": 1}
    assert isinstance(caught.value, RuntimeError)
    assert model.stats == work                                # no forward, no prefill
    assert_same_store(before, store_snapshot(model))
    assert reference.shape[0] == len(state.token_ids[0][0])

    after = ss.text(model)(state + " and then", max_tokens=4)
    tokens = (state + " and then").token_ids[0][0]
    assert after.token_ids[0][0] == manual_greedy(model, tokens, 4)


def test_a_hook_added_between_admission_and_forward_is_refused_and_the_batch_goes_on(fresh_tiny):
    model = fresh_tiny
    row = model.encode_prompt(PROMPT)
    batch = model.backend.batch()
    [slot] = batch.add([row], 4)
    hook = steer(model, after=0)
    try:
        with pytest.raises(ss.ActivationHookError):
            batch.forward([slot], [row[-1]])
    finally:
        hook.remove()
    logits = batch.forward([slot], [row[-1]])
    batch.close()
    assert_close(logits[0], manual_logits(model, row)[-1], model,
                 "logits after a refused hooked forward vs a fresh one", cap=1e-3)


@pytest.mark.parametrize("register", [torch_module.register_module_forward_hook,
                                      torch_module.register_module_forward_pre_hook])
def test_torch_global_hooks_are_refused_too(fresh_tiny, register):
    model = fresh_tiny
    work = model.stats
    hook = register(lambda *args: None)
    try:
        with pytest.raises(ss.ActivationHookError) as caught:
            ss.text(model)(PROMPT, max_tokens=2)
        assert caught.value.hooks == {"<global>": 1}
        with model.frozen_store():
            inside = ss.text(model)(PROMPT, max_tokens=2)
    finally:
        hook.remove()
    assert model.stats.prefill_tokens - work.prefill_tokens == len(model.encode_prompt(PROMPT)) - 1
    assert model.stats.kv_bytes_cached == work.kv_bytes_cached
    outside = ss.text(model)(PROMPT, max_tokens=2)
    assert outside.token_ids == inside.token_ids              # a no-op hook changes nothing


# -- scratch states: kept working, never reused --------------------------------------------------

def test_a_state_built_inside_keeps_working_and_a_clean_call_recomputes(fresh_tiny):
    model = fresh_tiny
    ss.text(model)("The quick brown fox", max_tokens=1)          # a stored clean prefix
    prompt_ids = model.encode_prompt(PROMPT)
    hook = steer(model, after=0)
    try:
        with model.frozen_store():
            hooked = ss.text(model)(PROMPT, max_tokens=6)
    finally:
        hook.remove()
    scratch = model.store.bytes_scratch
    assert scratch > 0                                             # pinned by `hooked`
    gc.collect()
    assert model.store.bytes_scratch == scratch

    # the same call, clean: recomputes the prompt past the clean prefix, matches a fresh run
    stored = model.store.match(prompt_ids).length
    work = model.stats
    clean = ss.text(model)(PROMPT, max_tokens=6)
    assert model.stats.prefill_tokens - work.prefill_tokens == len(prompt_ids) - 1 - stored
    assert clean.token_ids[0][0] == manual_greedy(model, prompt_ids, 6)
    assert clean.token_ids != hooked.token_ids                    # the hook mattered

    # the state made inside still works: sliced, continued (recomputed, clean)
    cut = hooked[..., :-2]
    more = ss.text(model)(cut + " yes", max_tokens=3)
    tokens = (cut + " yes").token_ids[0][0]
    assert more.token_ids[0][0] == manual_greedy(model, tokens, 3)
    assert str(hooked).startswith(PROMPT)
    del hooked, cut
    gc.collect()
    assert model.store.bytes_scratch == 0
    model.store.verify()


def test_frozen_store_is_reentrant_and_counts_blocks_of_every_thread(fresh_tiny):
    model = fresh_tiny
    store = model.store
    entered, leave = threading.Event(), threading.Event()

    def other():
        with model.frozen_store():
            entered.set()
            leave.wait(10)

    with model.frozen_store() as same:
        assert same is model
        with model.frozen_store():
            assert store.frozen
        assert store.frozen
    assert not store.frozen
    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(10)
    assert store.frozen                      # another thread's block freezes this model
    before = model.stats.kv_bytes_cached
    state = ss.text(model)(PROMPT, max_tokens=2)
    assert model.stats.kv_bytes_cached == before
    leave.set()
    thread.join()
    assert not store.frozen
    del state


# -- the real default model --------------------------------------------------------------------

@pytest.mark.real
def test_activation_patching_on_the_default_model(real):
    prefix = ss.text(real)("Q: What is the capital of France?\nA:", max_tokens=4)
    stored = len(prefix.token_ids[0][0])
    variant = prefix + " Paris is"
    tokens = variant.token_ids[0][0]
    before = store_snapshot(real)
    got, patched, expected, greedy = patching_run(real, tokens, stored, 5, scale=2.0, layer=10)
    assert (expected - manual_logits(real, tokens)[-1]).abs().max() > 0.1
    assert_close(got, expected, real, "patched logits vs the hooked model by hand", cap=1e-3)
    assert patched.token_ids[0][0] == greedy
    del patched
    assert_same_store(before, store_snapshot(real))


# -- llama.cpp: frozen_store() only stops writes ----------------------------------------------

def llama_snapshot(model):
    """The stored paths, the store's counters and its free sequences, after a full check."""
    gc.collect()
    model.backend.verify()
    store = model.store
    with store.lock:
        paths = {(node.start, node.tokens) for node in store.tree.nodes()}
    s = model.stats
    return paths, (s.kv_bytes_cached, s.segments, s.evictions, store.cells, store.free_seqs)


def fresh_greedy(model, tokens, n):
    """Greedy ``n`` tokens from the engine's own fresh evaluation (no stored KV)."""
    tokens = list(tokens)
    for _ in range(n):
        tokens.append(int(model.full_logits(tokens)[-1].argmax()))
    return tokens


def test_on_llama_cpp_frozen_store_stores_nothing():
    """Nothing is written inside the block.  (A store the session's earlier tests filled would
    evict unpinned paths to find sequences for the scratch rows, which a frozen store allows:
    the model here starts empty.)"""
    from conftest import request_llamacpp

    request_llamacpp()
    model = ss.models.default(engine="llama.cpp", n_ctx=8192, n_threads=1)
    prefix = ss.text(model)(PROMPT, max_tokens=4)
    before = llama_snapshot(model)
    shared = " ".join(["a long shared preamble that is not stored yet"] * 3)
    with model.frozen_store():
        more = ss.text(model)(prefix + " and then", max_tokens=5)
        forks = ss.text(model)(prefix[..., :-2], num_samples=3, sampler=ss.multinomial(),
                               seed=0, max_tokens=3)
        pair = ss.text(model)([shared + " one", shared + " two"], max_tokens=3)
        scores = prefix.score([" yes", " no"])
        model.backend.verify()                         # scratch paths are checked too
    assert model.store.free_seqs < before[1][-1]       # `more`, `forks`, `pair` hold scratch
    model.backend.verify()
    tokens = (prefix + " and then").token_ids[0][0]
    assert more.token_ids[0][0] == fresh_greedy(model, tokens, 5)
    for row, text in zip(pair.token_ids, [shared + " one", shared + " two"]):
        assert row[0] == fresh_greedy(model, model.encode_prompt(text), 3)
    assert forks.shape == (1, 3) and len(scores.sums[0][0]) == 2
    del more, forks, pair, scores
    assert llama_snapshot(model) == before

    # the same call outside the block recomputes what the scratch paths held, and stores it
    work, stored = model.stats, model.store.match(tokens).length
    again = ss.text(model)(prefix + " and then", max_tokens=5)
    assert again.token_ids[0][0] == fresh_greedy(model, tokens, 5)
    assert model.stats.prefill_tokens - work.prefill_tokens == len(tokens) - 1 - stored
    assert model.store.match(again.token_ids[0][0]).length > stored
