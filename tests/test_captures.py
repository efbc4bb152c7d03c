"""Named captures (``name=``): per row like ``value``, kept through concatenation, forks,
beams and resume, gone with a cut span; on every engine."""

import pytest

import seqstate as ss


def test_captures_follow_the_value_rule_and_survive_concat_and_fork(engine):
    s = ss.text(engine)("Name:", max_tokens=3, name="who")
    s = ss.choice(engine, ["yes", "no"])(s + " ok?", name="ok")
    assert s["who"] == s.captures["who"] == s.rows[0].spans[0].value
    assert s["ok"] in ("yes", "no") and set(s.captures) == {"who", "ok"}
    # concatenation keeps both sides' captures; a fork gives every sample the history
    other = ss.text(engine)("More", max_tokens=2, name="more")
    joined = s + other
    assert joined["who"] == s["who"] and joined["more"] == other["more"]
    forked = ss.text(engine)(s, num_samples=3, sampler=ss.multinomial(), seed=1, max_tokens=2,
                           name="tail")
    assert forked["who"] == [[s["who"]] * 3] and len(forked["tail"][0]) == 3
    # the same name again: the later call wins
    again = ss.text(engine)(s, max_tokens=2, name="who")
    assert again["who"] == again.value and again.captures["ok"] == s["ok"]


def test_a_cut_capture_is_gone_and_resume_keeps_the_name(engine):
    s = ss.text(engine)("Name:", max_tokens=6, name="who")
    start = s.rows[0].spans[0].start
    assert s.tokens[:start + 6]["who"] == s["who"]          # whole span kept
    cut = s.tokens[:-2]
    with pytest.raises(KeyError, match="no call named 'who'"):
        cut["who"]
    code = ss.regex(engine, "[a-z]{16}")
    s = code("Code:", name="code")
    span = s.rows[0].spans[-1]
    assert span.end - span.start >= 2
    resumed = code.resume(s.tokens[:span.start + 1])     # the constrained call goes on
    assert resumed["code"] == resumed.value and len(resumed.value) == 16


def test_free_text_resumes_like_constrained_calls(engine):
    text = ss.text(engine)
    s = text("Story:", max_tokens=12, name="story")
    span = s.rows[0].spans[-1]
    cut = s.tokens[:span.start + 5]
    resumed = text.resume(cut, max_tokens=7)
    reply = engine.vocab.decode(resumed.rows[0].tokens[span.start:])
    # one call, resumed: the capture is kept and the value is the whole reply, as for regex
    assert resumed.value == resumed["story"] == reply
    assert len(resumed.rows[0].spans) == 1 and resumed.rows[0].spans[0].start == span.start
    assert resumed.token_ids == s.token_ids                    # greedy: the same reply again


def test_each_beam_has_its_own_captures(engine):
    s = ss.text(engine)("Pick:", sampler=ss.beam_search(3), max_tokens=3, name="first")
    s = ss.text(engine)(s + ",", sampler=ss.beam_search(3), max_tokens=2, name="second")
    assert s.shape == (1, 3)
    for k in range(3):
        row = s.rows[k]
        first = next(sp for sp in row.spans if sp.name == "first")
        assert s["first"][0][k] == engine.vocab.decode(row.tokens[first.start:first.end])


def test_captures_per_row_on_a_batch(engine):
    s = ss.text(engine)(["a", "b"], max_tokens=2, name="x")
    assert s["x"] == s.value and len(s["x"]) == 2
