"""Constraint-guided speculation: drafts of forced text are verified, never forced."""

import collections

import pytest
import torch
from conftest import assert_close, needs, verify_store
from pydantic import BaseModel

import seqstate as ss
from seqstate.hooks import Replace, Rollback

CHI2_AT_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}      # chi-square critical values


def chi2_two_samples(a: list[int], b: list[int]) -> tuple[float, int]:
    """Pearson's statistic of a 2 x k contingency table, and its degrees of freedom."""
    cols = [(x, y) for x, y in zip(a, b) if x + y]
    na, nb = sum(x for x, _ in cols), sum(y for _, y in cols)
    stat = 0.0
    for x, y in cols:
        for observed, n in ((x, na), (y, nb)):
            expected = n * (x + y) / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(cols) - 1


class Customer(BaseModel):
    customer_full_name: str
    customer_age_in_years: int
    is_premium_subscriber: bool


def both(gen, prompt, **kw):
    """The call with and without speculation, and what the speculating one drafted."""
    model = gen.model
    plain = gen(prompt, speculate=False, **kw)
    before = model.stats
    fast = gen(prompt, **kw)
    return plain, fast, model.stats - before


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_greedy_output_and_logprobs_are_unchanged(engine, kind):
    needs(engine, "full_logits", "seqstate verifies its drafts against the logits of every "
          "drafted position; a server drafts on its own")
    gen = {"json": lambda m: ss.json(m, Customer),
           "regex": lambda m: ss.regex(m, r"The answer is (yes|no), because [a-z]{3,8}\."),
           "choice": lambda m: ss.choice(m, ["the cat sat on the mat", "the cat ran away"])}[kind]
    plain, fast, used = both(gen(engine), "Record:", max_tokens=60)
    assert used.draft_tokens_accepted > 0                 # it did speculate
    assert fast.token_ids == plain.token_ids and fast.value == plain.value
    pairs = [(a, b) for a, b in zip(plain.logprobs[0][0], fast.logprobs[0][0])]
    assert all((a is None) == (b is None) for a, b in pairs)
    assert_close([a for a, b in pairs if a is not None], [b for a, b in pairs if b is not None],
                 engine, "log-probs with and without drafts")
    verify_store(engine)


def test_a_large_batch_drafts_as_it_decodes_one_token_at_a_time(tiny):
    # 16 rows: each drafted position's rows are gathered into one kept tensor (the rows'
    # drafts differ in length once they reach the second key at different steps)
    prompts = [f"Record {k}:" + " more" * (k % 3) for k in range(16)]
    plain, fast, used = both(ss.json(tiny, Customer), prompts, max_tokens=40)
    assert used.draft_tokens_accepted > 0
    assert fast.token_ids == plain.token_ids
    for want, got in zip(plain.logprobs, fast.logprobs):
        for a, b in zip(want[0], got[0]):
            assert (a is None) == (b is None)
    assert_close([x for row in plain.logprobs for x in row[0] if x is not None],
                 [x for row in fast.logprobs for x in row[0] if x is not None],
                 tiny, "log-probs of 16 rows with and without drafts")


def test_logits_a_hook_keeps_from_a_draft_stay_as_they_were(tiny):
    # three rows drafting the schema's first key: each drafted position's rows are gathered
    # into one tensor, which a hook's event hands out, so it is a new one each position
    kept = []

    def keep(event):
        kept.append((event.logits, event.logits.clone()))

    plain, fast, used = both(ss.json(tiny, Customer), ["A:", "Record two:", "C"],
                             max_tokens=12, hooks=[keep])
    assert used.draft_tokens_accepted > 0 and fast.token_ids == plain.token_ids
    assert kept and all(torch.equal(a, b) for a, b in kept)


def test_speculate_false_drafts_nothing(tiny):
    before = tiny.stats
    ss.json(tiny, Customer)("x", speculate=False, max_tokens=30)
    used = tiny.stats - before
    assert used.draft_tokens_accepted == used.draft_tokens_rejected == 0


def test_a_rejected_draft_drops_its_kv(engine):
    """A hook replaces the first drafted token with another allowed spelling: the rest of the
    draft is rejected, and every stored log-prob still equals a fresh evaluation."""
    needs(engine, "full_logits", "seqstate verifies its drafts against the logits of every "
          "drafted position; a server drafts on its own")
    gen = ss.choice(engine, ["hello world, how are you"])
    first = engine.encode("hello world, how are you")[0]
    spelled = engine.encode("h")[0]
    assert first != spelled

    def respell(event):
        return Replace(spelled) if not event.generated and event.token == first else None

    before = engine.stats
    s = gen("Say:", hooks=[respell])
    used = engine.stats - before
    assert s.value == "hello world, how are you" and used.draft_tokens_rejected > 0
    ids = s.token_ids[0][0]
    fresh = engine.full_logits(ids).log_softmax(-1)
    start = s.rows[0].spans[-1].start
    for pos in range(start, len(ids)):
        assert_close(s.logprobs[0][0][pos], fresh[pos - 1, ids[pos]], engine,
                     "a log-prob after a rejected draft", cap=1e-3)
    verify_store(engine)


def test_hooks_see_every_accepted_token_in_order_and_rollback_inside_a_draft(tiny):
    gen = ss.choice(tiny, ["the cat sat on the mat today"])
    seen, rolled = [], []

    def watch(event):
        seen.append((event.position, event.token))
        if len(event.generated) == 3 and not rolled:     # inside the drafted text
            rolled.append(event.position)
            return Rollback(2)
        return None

    before = tiny.stats
    s = gen("Say:", hooks=[watch])
    assert (tiny.stats - before).draft_tokens_accepted > 0
    assert s.value == "the cat sat on the mat today" and rolled
    ids = s.token_ids[0][0]
    start = s.rows[0].spans[-1].start
    # the hook saw one position after another; after the rollback, from its first dropped
    # position on; and the last token it saw at each position is the row's token there
    cut = next(k for k, (pos, _) in enumerate(seen) if pos == rolled[0])
    before_cut, after_cut = [p for p, _ in seen[: cut + 1]], [p for p, _ in seen[cut + 1:]]
    assert before_cut == list(range(start, rolled[0] + 1))
    assert after_cut == list(range(rolled[0] - 2, len(ids)))[: len(after_cut)]
    last = dict(seen)
    assert [last[p] for p in range(start, len(ids))] == ids[start:]
    fresh = tiny.full_logits(ids).log_softmax(-1)
    for pos in range(start, len(ids)):
        assert_close(s.logprobs[0][0][pos], fresh[pos - 1, ids[pos]], tiny,
                     "a log-prob after a rollback inside a draft", cap=1e-3)


def test_stop_strings_and_streaming_inside_drafts(tiny):
    gen = ss.choice(tiny, ["alpha beta gamma delta"])
    s = gen("Say:", stop_at=" gamma")
    assert s.finish_reason == "stop" and str(s).endswith("alpha beta gamma")
    assert s == gen("Say:", stop_at=" gamma", speculate=False)
    chunks = list(gen.stream("Say:"))
    assert "".join(chunks) == "alpha beta gamma delta"


def test_beam_search_stays_token_by_token(tiny):
    before = tiny.stats
    ss.choice(tiny, ["the cat sat", "the cat ran"])("x", sampler=ss.beam_search(2))
    used = tiny.stats - before
    assert used.draft_tokens_accepted == used.draft_tokens_rejected == 0


def test_sampled_distribution_is_unchanged(tiny):
    """Chi-square: token-by-token and speculative sampling draw the same strings as often."""
    options = ["the cat sat on the mat", "the cat ran off", "the cat", "a dog barked loudly"]
    gen = ss.choice(tiny, options)
    sampler = ss.multinomial(temperature=4.0)
    counts = {}
    for spec in (False, True):
        before = tiny.stats
        s = gen("Pick:", num_samples=600, sampler=sampler, seed=11 if spec else 5,
                speculate=spec)
        counts[spec] = collections.Counter(s.value[0])
        if spec:
            assert (tiny.stats - before).draft_tokens_accepted > 0
    stat, df = chi2_two_samples([counts[False][o] for o in options],
                                [counts[True][o] for o in options])
    assert df >= 2                                       # several options really drawn
    assert stat < CHI2_AT_P001[df], (counts, stat)
