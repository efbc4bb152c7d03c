"""Beam search over programs, and option scoring, checked against fresh forwards."""

import pytest

import seqstate as ss
from conftest import assert_close


def fresh_logprob(model, tokens, start):
    """Sum of log-probs of tokens[start:] under a fresh full forward."""
    lp = model.full_logits(list(tokens)).log_softmax(-1)
    return sum(lp[i - 1, tokens[i]].item() for i in range(start, len(tokens)))


def test_width_one_is_greedy(tiny):
    for prompt in ["Hello there", "1, 2,"]:
        greedy = ss.text(tiny)(prompt, max_tokens=8)
        beam = ss.text(tiny)(prompt, max_tokens=8, sampler=ss.beam_search(1))
        assert beam.token_ids == greedy.token_ids


def enumerate_space(constraint, eos):
    """Every token sequence a constraint accepts (small spaces only)."""
    out, stack = [], [((), constraint.start())]
    while stack:
        toks, cur = stack.pop()
        allowed = cur.allowed().nonzero().flatten().tolist()
        if cur.complete:
            out.append(toks)
            continue
        if cur.accepting:
            out.append(toks)
        for t in allowed:
            if t not in eos:
                stack.append((toks + (t,), cur.advance(t)))
    return out


def test_beam_finds_the_true_best_of_a_small_space(tiny):
    prompt = tiny.encode("Pick:")
    c = ss.constraints.regex(tiny, r"[ab]{3}")
    space = enumerate_space(c, tiny.eos_token_ids)
    assert 8 <= len(space) <= 64
    scores = {seq: fresh_logprob(tiny, prompt + list(seq), len(prompt)) for seq in space}
    best = max(scores, key=scores.get)
    s = ss.regex(tiny, r"[ab]{3}")("Pick:", sampler=ss.beam_search(len(space)))
    assert tuple(s.token_ids[0][0][len(prompt):]) == best
    # every returned beam is a distinct member of the space, sorted best-first
    got = [tuple(t[len(prompt):]) for t in s.token_ids[0]]
    assert len(set(got)) == len(got) and set(got) <= set(space)
    w = s.weights[0].tolist()
    assert w == sorted(w, reverse=True)


def test_weights_equal_fresh_forward_sums(tiny):
    s = ss.text(tiny)("Once", max_tokens=5, sampler=ss.beam_search(3))
    n = len(tiny.encode("Once"))
    for row, w in zip(s.token_ids[0], s.weights[0].tolist()):
        assert_close(w, fresh_logprob(tiny, row, n), tiny, "a beam's weight", terms=len(row) - n)


def test_two_call_program_is_ranked_by_total_weight(tiny):
    first = ss.text(tiny)("Story:", max_tokens=4, sampler=ss.beam_search(3))
    s = ss.choice(tiny, ["good", "bad", "fine"])(first + " Label: ", sampler=ss.beam_search(3))
    assert s.shape == (1, 3)
    texts = [str(row) for row in s.rows]                # different texts (stories here)
    assert len(set(texts)) == len(texts)
    w = s.weights[0].tolist()
    assert w == sorted(w, reverse=True)
    n = len(tiny.encode("Story:"))
    for row, weight in zip(s.rows, w):
        toks = list(row.tokens)
        label_start = row.spans[-1].start
        # generated tokens of both calls count; the appended " Label: " does not
        total = fresh_logprob(tiny, toks[: row.spans[0].end], n) + fresh_logprob(tiny, toks, label_start)
        assert_close(weight, total, tiny, "a two-call beam's weight",
                     terms=row.spans[0].end - n + len(toks) - label_start)


def test_beam_shares_prefix_kv(fresh_tiny):
    m = fresh_tiny
    prompt = "A fairly long shared prompt for the beams to share. " * 4
    s = ss.text(m)(prompt, max_tokens=8, sampler=ss.beam_search(4))
    per_token = m.num_layers * 2 * m.kv_heads * m.head_dim * 4
    n = len(m.encode(prompt))
    assert m.stats.kv_bytes_cached <= (n + 4 * 8 * 2) * per_token
    assert s.shape == (1, 4)


def test_beam_rejects_mismatched_samples(tiny):
    with pytest.raises(ss.SampleMismatch):
        ss.text(tiny)("x", sampler=ss.beam_search(2), num_samples=3)
    with pytest.raises(ValueError):
        ss.beam_search(0)


def test_option_scoring_matches_fresh_forward(tiny):
    options = [" red", " green", " a long blue option"]
    for normalize in (True, False):
        s = ss.choice(tiny, options, method="score", length_normalize=normalize)("Colour:")
        prompt = tiny.encode("Colour:")
        for opt, score in s.scores.items():
            toks = prompt + tiny.encode(opt)
            total = fresh_logprob(tiny, toks, len(prompt))
            expect = total / len(tiny.encode(opt)) if normalize else total
            assert_close(score, expect, tiny, "an option's score",
                         terms=1 if normalize else len(tiny.encode(opt)))
        assert s.value == max(s.scores, key=s.scores.get)
        assert str(s) == "Colour:" + s.value


def test_option_scoring_prefills_only_options(fresh_tiny):
    m = fresh_tiny
    s = ss.text(m)("A prompt to reuse for scoring", max_tokens=2)
    before = m.stats
    ss.choice(m, [" yes", " no"], method="score")(s)
    d = m.stats - before
    # the state's last token once: its distribution scores both one-token options, and the
    # winner's KV (the state's) is already stored
    assert d.prefill_tokens + d.decode_tokens == 1


@pytest.mark.real
def test_beams_are_texts_not_token_paths(real):
    """ "Paris" as one token and as "Par" + "is" are one hypothesis: a beam over three options
    returns the three options (token paths gave "Paris" twice and lost "Marseille")."""
    options = ["Paris", "Lyon", "Marseille"]
    s = ss.choice(real, options)("The capital of France is ", sampler=ss.beam_search(3))
    assert sorted(s.value[0]) == sorted(options)
    w = s.weights[0].tolist()
    assert w == sorted(w, reverse=True)
    for row, weight in zip(s.rows, w):                 # each its own spelling's log-prob
        start = row.spans[-1].start
        assert_close(weight, fresh_logprob(real, list(row.tokens), start), real,
                     "a beam's weight", terms=len(row.tokens) - start)


@pytest.mark.real
def test_beam_program_on_real_model(real):
    s = ss.text(real)("Q: name a colour.\nA:", max_tokens=6, stop_at="\n", sampler=ss.beam_search(3))
    s = ss.choice(real, ["yes", "no"])(s + "Is it warm? ", sampler=ss.beam_search(3))
    assert s.shape[0] == 1 and 1 <= s.shape[1] <= 3
    w = s.weights[0].tolist()
    assert w == sorted(w, reverse=True)
