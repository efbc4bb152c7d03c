"""``state.score`` and ``state.next_logprobs``: exact against a fresh evaluation on every kind
of state, each prefix computed once, continuation KV scratch, errors before compute."""

import random

import pytest
import torch

import seqstate as ss
from seqstate.backends import teacher_forcing
from seqstate.backends.hf import packed
from seqstate.errors import ArgumentError, BatchMismatch, ContextOverflowError

from conftest import assert_close, fresh_logprobs


def _check(reference, state, scores):
    """Every token's log-prob and greedy flag against ``reference``'s fresh evaluation of
    row + option."""
    start = state.model.start_token_ids
    for b in range(state.n_batch):
        for s in range(state.n_samples):
            row = list(state.row(b, s).tokens) or list(start)
            for c, lps, greedy in zip(scores.tokens[b][s], scores.logprobs[b][s],
                                      scores.greedy[b][s]):
                fresh = fresh_logprobs(reference, row + list(c))
                at = torch.arange(len(row) - 1, len(row) - 1 + len(c))
                want = fresh[at, torch.tensor(c)]
                assert_close(lps, want, reference, "scored log-probs vs a fresh evaluation")
                assert greedy == bool((fresh[at].argmax(-1) == torch.tensor(c)).all())


def _states(model):
    """States built every way: a generator call (stored KV), from_tokens (none), a slice, a
    1x3 fork, and a ragged batch."""
    gen = ss.text(model)(["Question: what is 2+2?\nAnswer:", "The capital of France is"],
                         max_tokens=4)
    fork = ss.text(model)("Once upon a time", max_tokens=3, num_samples=3,
                          sampler=ss.multinomial(), seed=3)
    ragged = ss.from_tokens(model, [model.encode("Hi"), model.encode("A much longer row of "
                                                                     "text than the first")])
    return {"generated": gen, "from_tokens": ss.from_tokens(model, [model.encode("Tea or")]),
            "sliced": gen.tokens[:-2], "forked": fork, "ragged": ragged}


@pytest.mark.parametrize("kind", ["generated", "from_tokens", "sliced", "forked", "ragged"])
def test_score_equals_a_fresh_evaluation(engine, reference, kind):
    state = _states(engine)[kind]
    ids = engine.encode(" and then some more words")[:6]
    shared = [" yes", " no, never", ids, engine.encode(" x")[:1], " a b c d e f g h"]
    _check(reference, state, state.score(shared))


def test_score_one_list_per_batch_item(engine, reference):
    state = _states(engine)["ragged"]
    per_item = [[" there", [engine.encode(" you")[0]]], [" A", " B", " C and D"]]
    scores = state.score(per_item)
    assert [len(x[0]) for x in scores.tokens] == [2, 3]
    assert scores.sums.shape == (2, 1, 3) and scores.sums[0, 0, 2].isnan()
    assert not scores.sums[1].isnan().any()
    _check(reference, state, scores)
    means = scores.means[1, 0]          # the same floats averaged in another order: ~1 ulp
    assert means.tolist() == pytest.approx([sum(x) / len(x) for x in scores.logprobs[1][0]])
    first, second = int(scores.sums[0, 0, :2].argmax()), int(scores.sums[1, 0].argmax())
    assert scores.best_index().tolist() == [[first], [second]]
    # best(): the options as given, a text or a tuple of token ids
    given = [[" there", (engine.encode(" you")[0],)], [" A", " B", " C and D"]]
    assert scores.best() == [[given[0][first]], [given[1][second]]]
    assert scores.best("means") == [[given[b][int(scores.means[b, 0].nan_to_num(-1e9).argmax())]]
                                    for b in range(2)]


def test_a_tail_longer_than_a_chunk_is_exact(tiny, monkeypatch):
    """Continuations fed in several forwards (chunks) score exactly; one longer than the
    default chunk of 1,024 tokens too."""
    state = ss.from_tokens(tiny, [tiny.encode("Read this:")])
    text = " ".join(f"word{i}" for i in range(400))
    long = tiny.encode(text)[:1100]
    assert len(long) > teacher_forcing.CHUNK
    _check(tiny, state, state.score([long, " short one"]))
    monkeypatch.setattr(teacher_forcing, "CHUNK", 3)
    _check(tiny, state, state.score([" a longer continuation of several tokens", " b"]))


def test_chunks_on_llama_cpp(llama, monkeypatch):
    monkeypatch.setattr(teacher_forcing, "CHUNK", 2)
    state = ss.from_tokens(llama, [llama.encode("Read this:"), llama.encode("Then")])
    _check(llama, state, state.score([" a longer continuation of several tokens", " b"]))
    llama.backend.verify()


def test_options_sharing_a_run_fork_on_every_engine(engine, reference, monkeypatch):
    """The trie walk (a shared run fed once, forks where options part), in chunks, on every
    engine: exact against each engine's reference; llama.cpp's sequences check out."""
    monkeypatch.setattr(teacher_forcing, "CHUNK", 2)
    state = ss.from_tokens(engine, [engine.encode("The tower is in"), engine.encode("It is")])
    _check(reference, state, state.score([" the city of Paris", " the city of Lyon, France",
                                       " the city", " a town"]))
    if engine.engine == "llama.cpp":
        engine.backend.verify()


def test_next_logprobs_is_exact_and_independent_of_other_rows(engine, reference):
    rng = random.Random(0)
    words = engine.encode(" ".join(["alpha", "beta", "gamma", "delta", "tea", "sky"] * 10))
    rows = [words[: rng.randint(1, 40)] for _ in range(7)] + [[]]
    lp = ss.from_tokens(engine, rows).next_logprobs()
    assert lp.shape == (8, 1, engine.vocab.size) and lp.dtype == torch.float32
    for row, got in zip(rows, lp[:, 0]):
        tokens = row or engine.start_token_ids
        alone = ss.from_tokens(engine, [tokens]).next_logprobs()[0, 0]
        assert_close(got, alone, reference, "next_logprobs: a row among 8 vs alone")
        assert_close(got, fresh_logprobs(reference, tokens)[-1], reference,
                     "next_logprobs vs a fresh evaluation")


def test_branching_a_prefix_and_comparing_next_token_distributions(tiny):
    base = ss.from_tokens(tiny, [tiny.encode("When Mary and John went to the store,")])
    variants = base + [" John gave a drink to", " Mary gave a drink to"]
    assert variants.shape == (2, 1) and variants.rows[0].tokens[:len(base.rows[0].tokens)] \
        == base.rows[0].tokens
    lp = variants.next_logprobs()
    mary, john = tiny.encode(" Mary")[0], tiny.encode(" John")[0]
    diff = lp[:, 0, mary] - lp[:, 0, john]
    for i, row in enumerate(variants.rows):
        fresh = tiny.full_logits(list(row.tokens))[-1]
        assert_close(diff[i], fresh[mary] - fresh[john], tiny, "a next-token log-odds",
                     terms=2)
    # a 1x3 state branches into 2 batch items of 3 samples; a 2-item state takes one each
    forked = ss.text(tiny)("Hi", max_tokens=1, num_samples=3, sampler=ss.multinomial(), seed=1)
    assert (forked + [" a", " b"]).shape == (2, 3)
    two = ss.from_tokens(tiny, [[1, 2], [3, 4]])
    assert (two + [" a", " b"]).texts == [[two.texts[0][0] + " a"], [two.texts[1][0] + " b"]]


def _trie_size(paths):
    nodes = set()
    for p in paths:
        nodes.update(tuple(p[:i]) for i in range(1, len(p) + 1))
    return len(nodes)


def test_each_prefix_is_computed_once_and_continuations_are_not_stored(fresh_tiny):
    """10 questions x 4 options behind a ~100-token shared prefix: the tokens through the model
    are the trie of context + option[:-1]; the store keeps the contexts only."""
    m = fresh_tiny
    shots = m.encode(" ".join(f"Example {i}: the answer is {i * 7}." for i in range(12)))
    assert 90 <= len(shots) <= 140
    contexts = [shots + m.encode(f" Question {q}: how many {q}?") for q in range(10)]
    words = ["apples", "boats", "clouds", "dogs"]
    options = [[m.encode(f" {w} ({q * k} of them)") for k, w in enumerate(words)]
               for q in range(10)]
    state = ss.from_tokens(m, contexts)
    before = m.stats
    scores = state.score(options)
    used = m.stats - before
    trie = _trie_size([c + o[:-1] for c, opts in zip(contexts, options) for o in opts])
    assert used.prefill_tokens + used.decode_tokens == trie
    # stored: the contexts, not the continuations
    assert m.stats.kv_bytes_cached == _trie_size(contexts) * _bytes_per_token(m)
    again = m.stats
    assert_close(state.score(options).sums, scores.sums, m, "sums, contexts now cached",
                 terms=max(len(o) for opts in options for o in opts))
    second = m.stats - again
    # a second identical call: each context's last token (its distribution) and the options
    assert second.prefill_tokens == 0
    assert second.decode_tokens == len(contexts) + sum(len(o) - 1 for opts in options
                                                       for o in opts)
    assert m.stats.kv_bytes_cached == _trie_size(contexts) * _bytes_per_token(m)


@pytest.mark.parametrize("line", [1, 48, 4096])
def test_contexts_side_by_side_on_one_row_are_exact(fresh_tiny, monkeypatch, line):
    """The HF engine puts contexts side by side on one row of a forward, each seeing its own
    stored past (the row's past is the union of their stored paths): contexts whose stored
    paths differ (one stored beforehand with a longer prefix, questions that share their
    first words, one with nothing stored), options of shared beginnings, lines of one
    context, a few and all of them.  Every log-prob is exact, each context is stored, and
    side by side takes fewer forwards than one context a row."""
    m = fresh_tiny
    monkeypatch.setattr(packed, "LINE_COLUMNS", line)
    shots = m.encode(" ".join(f"Example {i}: the answer is {i * 7}." for i in range(6)))
    ss.from_tokens(m, [shots + m.encode(" Question 3: how many")]).score([" x"])  # stored
    contexts = [shots + m.encode(f" Question {q}: how many {'dogs' * (q % 3)}?")
                for q in range(9)] + [m.encode("Unrelated: a text of its own?")]
    options = [[m.encode(f" {w} ({q * k})") for k, w in enumerate(["one", "one more", "two"])]
               for q in range(len(contexts))]
    rows = []
    score_group = packed._score_group
    monkeypatch.setattr(packed, "_score_group", lambda backend, group, pairs: (
        rows.append(len(group)), score_group(backend, group, pairs))[1])
    state = ss.from_tokens(m, contexts)
    scores = state.score(options)
    _check(m, state, scores)
    for context in contexts:                                           # each context stored
        assert m.store.match(context).length == len(context)
    # rows through the model; at any width the unrelated context keeps a row of its own: the
    # past the others would add to it is more than the columns it feeds
    assert sum(rows) == {1: len(contexts), 48: 4, 4096: 2}[line]


def test_options_that_begin_alike_feed_their_common_part_once(fresh_tiny):
    """Continuations sharing tokens beyond the first (" the city of Paris" / " the city of
    Lyon") are fed as a trie: the shared run once, then a fork per branch; every log-prob
    still equals a fresh evaluation."""
    m = fresh_tiny
    context = m.encode("Where is the tower? It stands in")
    options = [m.encode(t) for t in (" the city of Paris", " the city of Lyon, France",
                                     " the city", " a small town", " a small town nearby")]
    state = ss.from_tokens(m, [context])
    state.score([[1]])                                   # the context stored first
    before = m.stats
    scores = state.score(options)
    used = m.stats - before
    # the context's last token once, then the trie of the options' fed tokens
    assert used.prefill_tokens == 0
    assert used.decode_tokens == 1 + _trie_size([o[:-1] for o in options if len(o) > 1])
    assert used.decode_tokens < 1 + sum(len(o) - 1 for o in options)
    for j, option in enumerate(options):
        ref = m.full_logits(context + option).log_softmax(-1)
        want = [float(ref[len(context) - 1 + k, t]) for k, t in enumerate(option)]
        assert_close(scores.logprobs[0][0][j], want, m, "a trie-fed option's log-probs")
        greedy = all(int(ref[len(context) - 1 + k].argmax()) == t for k, t in enumerate(option))
        assert scores.greedy[0][0][j] == greedy


def _bytes_per_token(m) -> int:
    b = m.backend
    return b.num_layers * 2 * b.kv_heads * b.head_dim * torch.finfo(b.dtype).bits // 8


def test_store_true_keeps_the_continuations(fresh_tiny):
    m = fresh_tiny
    state = ss.from_tokens(m, [m.encode("Pick a colour:")])
    options = [m.encode(" deep red"), m.encode(" blue")]
    state.score(options, store=True)
    row = list(state.rows[0].tokens)
    for o in options:
        assert m.backend.store.match(row + o).length == len(row) + len(o) - 1
    before = m.stats
    ss.text(m)(state + " deep red", max_tokens=1)
    assert (m.stats - before).prefill_tokens == 0


def test_scored_choice_stores_only_the_winner(fresh_tiny):
    m = fresh_tiny
    texts = [" red", " green", " blue sky today"]
    state = ss.choice(m, texts, method="score")("Choose:")
    row = list(state.rows[0].tokens)
    prompt = m.encode_prompt("Choose:")
    winner = row[len(prompt):]
    assert m.backend.store.match(row).length == len(row) - 1
    losers = [m.encode(t) for t in texts if m.encode(t) != winner]
    assert len(losers) == 2 and all(ids[0] != winner[0] for ids in losers)
    for ids in losers:
        assert m.backend.store.match(prompt + ids).length == len(prompt)
    alone = ss.from_tokens(m, [prompt]).score(texts).means[0, 0]       # length-normalised
    assert_close([state.scores[t] for t in texts], alone, m, "a scored choice's means")


@pytest.mark.parametrize("bad, error", [
    ("yes", ArgumentError), ([], ArgumentError), ([""], ArgumentError),
    ([[10 ** 9]], ArgumentError), ([[]], ArgumentError), ([" a", [[" b"]]], ArgumentError),
    ([[" a"], [" b"], [" c"]], BatchMismatch), ([3.5], ArgumentError),
])
def test_bad_continuations_are_refused_before_compute(tiny, bad, error):
    state = ss.from_tokens(tiny, [tiny.encode("Hello"), tiny.encode("There")])
    before = tiny.stats
    with pytest.raises(error):
        state.score(bad)
    assert tiny.stats == before


def test_a_row_and_continuation_past_the_context_are_refused(tiny):
    """The continuation's last token is never fed: a row and continuation that fill the
    context exactly plus that token are scored; one more is refused before compute."""
    state = ss.from_tokens(tiny, [[5] * (tiny.context_length - 2)])
    assert len(state.score([[7, 8, 9]]).logprobs[0][0][0]) == 3
    before = tiny.stats
    with pytest.raises(ContextOverflowError):
        state.score([[7, 8, 9, 10]])
    assert tiny.stats == before


def test_score_on_the_real_model_is_exact(real):
    """Three ARC-Easy questions behind their 5-shot prefix on SmolLM2."""
    import gzip
    import json
    import pathlib

    data = pathlib.Path(__file__).parents[2] / "shared/data/arc_easy/rc_5shot.requests.jsonl.gz"
    with gzip.open(data, "rt") as f:
        requests = [r for r in map(json.loads, f) if r["doc_id"] < 3]
    contexts = list(dict.fromkeys(r["request"]["context"] for r in requests))
    answers = [[r["request"]["continuation"] for r in requests if r["request"]["context"] == c]
               for c in contexts]
    state = ss.from_tokens(real, [real.encode_prompt(c) for c in contexts])
    _check(real, state, state.score(answers))


MEMORY_SCRIPT = """
import seqstate as ss
m = ss.models.testing.tiny()
shots = m.encode(" ".join(f"Example {i}: the answer is {i * 7}." for i in range(12)))
contexts = [shots + m.encode(f" Question {q}: what is {q} plus {q * 3}? Answer:")
            for q in range(600)]
options = [[m.encode(f" {q * k + 1} apples and {k} pears") for k in range(4)]
           for q in range(600)]
scores = ss.from_tokens(m, contexts).score(options)
assert scores.sums.shape == (600, 1, 4) and not scores.sums.isnan().any()
# this process's own peak (ru_maxrss would include the forking parent's, kept across exec)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmHWM"].split()[0]))
"""


def test_600_questions_of_4_options_in_one_call_stay_under_2_gb():
    """Memory is bounded by the scoring budget, not by the number of pairs: all 2,400 pairs
    at once would need ~3.8 GB of logits alone (2,400 x 8 positions x 49,152 x 4 bytes)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True,
                         text=True, check=True, timeout=600)
    peak_kib = int(out.stdout.split()[-1])
    assert peak_kib < 2 * 1024 * 1024


def _fresh(kind):
    """A model of its own: an empty store, so what is fed is the whole trie.  llama.cpp's
    12 sequences allow 3 rows a scoring group (the HF engine's budget is patched by the
    caller), fewer than a question's 5 options, and hold the stored questions unevicted."""
    if kind == "hf":
        return ss.models.testing.tiny()
    from conftest import request_llamacpp

    request_llamacpp()
    return ss.models.default(engine="llama.cpp", n_ctx=2048, n_seq_max=12, n_threads=1)


@pytest.mark.parametrize("kind", ["hf", "llama.cpp"])
def test_every_prefix_is_fed_exactly_once_where_questions_and_options_begin_alike(kind,
                                                                                  monkeypatch):
    """ARC-like questions whose contexts share a few leading tokens ("Question: What
    measures") and whose options share theirs (" a thermometer" / " a barometer"), one option
    a prefix of another (" the moon" / " the moon and the sun"): the tokens through the model
    are exactly the trie of context + option[:-1], however the budget groups the pairs, and
    every log-prob is still exact.  Budgets too small for a question's options cut them
    between " a ..." and " the ...", which share no fed token."""
    m = _fresh(kind)
    monkeypatch.setattr(teacher_forcing, "SCORE_BATCH_TOKENS", 64)     # 4 options of ~15 tokens
    questions = ["What measures air pressure?", "Which body shines at night?",
                 "What measures heat?", "What measures length?", "Which body is largest?",
                 "What is the Sun?"]
    texts = [" a thermometer", " a barometer", " the moon", " the moon and the sun",
             " a ruler"]
    contexts = [m.encode(f"Question: {q}\nAnswer:") for q in questions]
    options = [[m.encode(t) for t in texts] for _ in questions]
    assert m.stats.prefill_tokens + m.stats.decode_tokens == 0
    state = ss.from_tokens(m, contexts)
    scores = state.score(options)
    trie = _trie_size([c + o[:-1] for c, opts in zip(contexts, options) for o in opts])
    assert m.stats.evictions == 0                       # nothing computed twice for want of room
    assert m.stats.prefill_tokens + m.stats.decode_tokens == trie
    _check(m, state, scores)
    if kind == "llama.cpp":
        m.backend.verify()
