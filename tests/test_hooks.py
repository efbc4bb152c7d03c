"""Hooks: accept/replace/resample/rollback; banned phrases; bounded backtracking; exactness."""

import re

import pytest

import seqstate as ss
from seqstate.engine import next_logprobs
from seqstate.hooks import Replace, Resample, Rollback

from conftest import assert_close


class RollbackOnce:
    """Rolls back ``n`` tokens the first time the row reaches ``at`` generated tokens."""

    def __init__(self, at, n):
        self.at, self.n, self.fired, self.banned = at, n, False, None

    def __call__(self, event):
        if not self.fired and len(event.generated) == self.at:
            self.fired = True
            self.banned = event.generated[self.at - self.n]
            return Rollback(self.n)
        return None


def fresh_match(model, state):
    rows = [list(r.tokens) for r in state.rows]
    got = next_logprobs(model, rows)
    for r, g in zip(rows, got):
        assert_close(g, model.full_logits(r)[-1].log_softmax(-1), model,
                     "logits after hooks vs a fresh forward", cap=1e-3)


def test_rollback_keeps_kv_exact_and_constraint_and_does_not_prefill(fresh_tiny):
    m = fresh_tiny
    prompt = ss.text(m)("Numbers please:", max_tokens=1)
    hook = RollbackOnce(at=5, n=3)
    before = m.stats
    s = ss.regex(m, r"[0-9]{10}")(prompt, hooks=[hook], sampler=ss.multinomial(), seed=0)
    d = m.stats - before
    assert hook.fired
    assert d.prefill_tokens == 0                 # everything before was stored: no re-prefill
    assert re.fullmatch(r"[0-9]{10}", s.value)
    gen = s.token_ids[0][0][len(prompt.token_ids[0][0]):]
    assert gen[2] != hook.banned                 # the first dropped token is banned there
    new_lps = s.logprobs[0][0][len(prompt.token_ids[0][0]):]
    assert len(new_lps) == len(gen) and all(lp is not None for lp in new_lps)
    fresh_match(m, s)


def test_replace_and_resample(tiny):
    target = tiny.encode(" zebra")[0]
    s = ss.text(tiny)("x", max_tokens=3, hooks=[lambda e: Replace(target) if e.position == 1 else None])
    assert s.token_ids[0][0][1] == target
    first = ss.text(tiny)("x", max_tokens=1).token_ids[0][0][-1]
    s = ss.text(tiny)("x", max_tokens=1, hooks=[lambda e: Resample() if e.token == first else None])
    assert s.token_ids[0][0][-1] != first


def test_replace_must_satisfy_the_constraint(tiny):
    bad = tiny.encode("x")[0]
    with pytest.raises(ss.HookError, match="does not allow"):
        ss.regex(tiny, r"[0-9]+")("n:", hooks=[lambda e: Replace(bad)])


def test_backtracking_is_bounded(tiny):
    always = lambda e: Rollback(1) if e.generated else Resample()  # noqa: E731
    s = ss.text(tiny)("x", max_tokens=10, hooks=[always], max_backtracks=5)
    assert s.finish_reason == "max_backtracks"


def test_hook_errors_are_clear(tiny):
    with pytest.raises(ss.HookError, match="expected None"):
        ss.text(tiny)("x", max_tokens=2, hooks=[lambda e: "nope"])
    with pytest.raises(ss.HookError, match="roll back 5"):
        ss.text(tiny)("x", max_tokens=2, hooks=[lambda e: Rollback(5)])


def test_event_fields(tiny):
    seen = []
    ss.text(tiny)("abc", max_tokens=3, hooks=[lambda e: seen.append(e)])
    e = seen[-1]
    assert e.position == len(tiny.encode("abc")) + 2 and len(e.generated) == 2
    assert 0 < e.prob <= 1 and len(e.top) == 5 and e.logits.shape[-1] == tiny.vocab.size
    assert e.text == tiny.vocab.decode(e.generated)


def test_ban_phrases_across_token_boundaries(tiny):
    free = ss.text(tiny)("Once", max_tokens=20).value
    phrase = free[5:12]
    s = ss.text(tiny)("Once", max_tokens=20, hooks=[ss.hooks.ban_phrases([phrase])])
    assert phrase.lower() not in s.value.lower()
    # the text before the token where the phrase began is kept as it was
    toks = tiny.encode("Once")
    gen_free = ss.text(tiny)("Once", max_tokens=20).token_ids[0][0][len(toks):]
    starts = [len(tiny.vocab.decode(gen_free[:i])) for i in range(len(gen_free))]
    keep = max(off for off in starts if off <= free.lower().index(phrase.lower()))
    assert s.value[:keep] == free[:keep]


def test_ban_phrases_regex_and_case(tiny):
    free = ss.text(tiny)("Once", max_tokens=20).value
    word = free[3:8]
    s = ss.text(tiny)("Once", max_tokens=20, hooks=[ss.hooks.ban_phrases([re.escape(word.upper())],
                                                                        regex=True)])
    assert word.lower() not in s.value.lower()
    with pytest.raises(ss.ConstraintError):
        ss.hooks.ban_phrases([])
    with pytest.raises(ss.ConstraintError):
        ss.hooks.ban_phrases(["(unclosed"], regex=True)


def test_ban_phrases_match_inside_words_unless_whole_words(tiny):
    free = ss.text(tiny)("Once", max_tokens=30).value
    word = next(m.group(1) for m in re.finditer(r" ([A-Za-z]{6,}) ", free))
    inside = word[1:-1]                       # "car" inside "scars": part of a longer word
    assert not re.search(rf"(?<!\w){inside}(?!\w)", free, re.I)
    banned = ss.text(tiny)("Once", max_tokens=30, hooks=[ss.hooks.ban_phrases([inside])])
    assert inside.lower() not in banned.value.lower()
    kept = ss.text(tiny)("Once", max_tokens=30,
                         hooks=[ss.hooks.ban_phrases([inside], whole_words=True)])
    assert kept.value == free                 # only whole words are banned: nothing to do
    whole = ss.text(tiny)("Once", max_tokens=30,
                          hooks=[ss.hooks.ban_phrases([word], whole_words=True)])
    assert not re.search(rf"(?<!\w){word}(?!\w)", whole.value[:-1], re.I)
    assert whole.value[:free.index(word)] == free[:free.index(word)]


def test_a_whole_word_ban_that_the_constraint_forces_is_refused_up_front(fresh_tiny):
    words = ss.hooks.ban_phrases(["car"], whole_words=True)
    before = fresh_tiny.stats
    with pytest.raises(ss.ConstraintError, match="banned phrase"):
        ss.choice(fresh_tiny, ["car", "Car"])("A word: ", hooks=[words])
    assert (fresh_tiny.stats - before).forward_calls == 0      # refused before compute
    # the start and end of the text bound a word; "carcar" and "scar" hold no whole "car"
    assert [words.forced_by(r) for r in ("car", "the car is", "(car)+", "scar|car", "s?car")] \
        == [True, True, False, False, False]
    assert ss.choice(fresh_tiny, ["scar", "cart"])("A word: ", hooks=[words]).value \
        in ("scar", "cart")


def test_ban_that_the_constraint_forces_is_reported_before_compute(fresh_tiny):
    before = fresh_tiny.stats
    with pytest.raises(ss.ConstraintError, match="banned phrase"):
        ss.choice(fresh_tiny, ["Forbidden fruit", "forbidden zone"])("x", hooks=[ss.hooks.ban_phrases(["forbidden"])])
    with pytest.raises(ss.ConstraintError, match="banned phrase"):
        ss.regex(fresh_tiny, r"ab[0-9]+")("x", hooks=[ss.hooks.ban_phrases([r"b\d"], regex=True)])
    assert (fresh_tiny.stats - before).forward_calls == 0
    # a constraint that can avoid the phrase runs, and avoids it
    s = ss.choice(fresh_tiny, ["forbidden", "fine"])("x", hooks=[ss.hooks.ban_phrases(["forbidden"])])
    assert s.value == "fine"


def test_undetectable_forced_phrase_ends_as_dead_end(tiny):
    # a grammar constraint is not analysed up front: the row ends instead of emitting the phrase
    grammar = 'start: "forbidden"'
    s = ss.cfg(tiny, grammar)("x", hooks=[ss.hooks.ban_phrases(["forbidden"])])
    assert s.finish_reason in ("dead_end", "max_backtracks")
    assert "forbidden" not in (s.value or "")


@pytest.mark.real
def test_ban_phrases_on_real_model(real):
    free = ss.text(real)("Once upon a time", max_tokens=30).value
    banned = ["Nova Haven", "metropolis", "skyscrapers"]
    assert any(b in free for b in banned)
    s = ss.text(real)("Once upon a time", max_tokens=30, hooks=[ss.hooks.ban_phrases(banned)])
    assert not any(b.lower() in s.value.lower() for b in banned)


def test_hooks_chain_in_order(tiny):
    """A Replace hands its token to later hooks; a Resample re-runs every hook on the new token."""
    seen = []
    first = ss.text(tiny)("x", max_tokens=1).token_ids[0][0][-1]
    target = tiny.encode(" zebra")[0]
    replace_first = lambda e: Replace(target) if e.token == first else None  # noqa: E731
    record = lambda e: seen.append(e.token)  # noqa: E731
    s = ss.text(tiny)("x", max_tokens=1, hooks=[replace_first, record])
    assert seen == [target] and s.token_ids[0][0][-1] == target
    seen.clear()
    resample_first = lambda e: Resample() if e.token == first else None  # noqa: E731
    s = ss.text(tiny)("x", max_tokens=1, hooks=[record, resample_first])
    assert seen[0] == first and seen[-1] == s.token_ids[0][0][-1] != first and len(seen) == 2


def test_rollback_zero_is_a_resample_and_negative_is_an_error(tiny):
    seen = []

    def once(event):
        seen.append(event.token)
        return Rollback(0) if len(seen) == 1 else None

    s = ss.text(tiny)("Hello", max_tokens=2, hooks=[once])
    assert s.token_ids[0][0][-2] != seen[0]           # the first sampled token was banned there
    with pytest.raises(ss.HookError, match="n >= 0"):
        ss.text(tiny)("Hello", max_tokens=2, hooks=[lambda e: Rollback(-1)])
    with pytest.raises(ss.HookError):
        Rollback(1.5)


def test_ban_phrase_that_begins_in_the_prompt(tiny):
    base = ss.text(tiny)("The weather is", max_tokens=1)
    nxt = base.token_ids[0][0][-1]
    phrase = "is" + tiny.vocab.decode([nxt])          # "is" from the prompt + the greedy token
    prompt = base[..., :-1]
    ban = ss.hooks.ban_phrases([phrase], ignore_case=False)
    s = ss.text(tiny)(prompt, max_tokens=3, hooks=[ban])
    assert phrase not in str(s)
    assert s.token_ids[0][0][len(prompt.token_ids[0][0])] != nxt
