"""Programs as users write them: captures, chat, signatures, defaults, progress, accessors,
sampling options (issue 15)."""

import copy
import dataclasses
import inspect
import pathlib

import pytest
import torch

import seqstate as ss
from seqstate.call import Call

from conftest import assert_close

# -- named captures ------------------------------------------------------------------------------


def test_captures_follow_the_value_rule_and_survive_concat_and_fork(tiny):
    s = ss.text(tiny)("Name:", max_tokens=3, name="who")
    s = ss.choice(tiny, ["yes", "no"])(s + " ok?", name="ok")
    assert s["who"] == s.captures["who"] == s.rows[0].spans[0].value
    assert s["ok"] in ("yes", "no") and set(s.captures) == {"who", "ok"}
    # concatenation keeps both sides' captures; a fork gives every sample the history
    other = ss.text(tiny)("More", max_tokens=2, name="more")
    joined = s + other
    assert joined["who"] == s["who"] and joined["more"] == other["more"]
    forked = ss.text(tiny)(s, num_samples=3, sampler=ss.multinomial(), seed=1, max_tokens=2,
                           name="tail")
    assert forked["who"] == [[s["who"]] * 3] and len(forked["tail"][0]) == 3
    # the same name again: the later call wins
    again = ss.text(tiny)(s, max_tokens=2, name="who")
    assert again["who"] == again.value and again.captures["ok"] == s["ok"]


def test_a_cut_capture_is_gone_and_resume_keeps_the_name(tiny):
    s = ss.text(tiny)("Name:", max_tokens=6, name="who")
    start = s.rows[0].spans[0].start
    assert s.tokens[:start + 6]["who"] == s["who"]          # whole span kept
    cut = s.tokens[:-2]
    with pytest.raises(KeyError, match="no call named 'who'"):
        cut["who"]
    code = ss.regex(tiny, "[a-z]{16}")
    s = code("Code:", name="code")
    span = s.rows[0].spans[-1]
    assert span.end - span.start >= 2
    resumed = code.resume(s.tokens[:span.start + 1])     # the constrained call goes on
    assert resumed["code"] == resumed.value and len(resumed.value) == 16


def test_free_text_resumes_like_constrained_calls(tiny):
    text = ss.text(tiny)
    s = text("Story:", max_tokens=12, name="story")
    span = s.rows[0].spans[-1]
    cut = s.tokens[:span.start + 5]
    resumed = text.resume(cut, max_tokens=7)
    reply = tiny.vocab.decode(resumed.rows[0].tokens[span.start:])
    # one call, resumed: the capture is kept and the value is the whole reply, as for regex
    assert resumed.value == resumed["story"] == reply
    assert len(resumed.rows[0].spans) == 1 and resumed.rows[0].spans[0].start == span.start
    assert resumed.token_ids == s.token_ids                    # greedy: the same reply again


def test_each_beam_has_its_own_captures(tiny):
    s = ss.text(tiny)("Pick:", sampler=ss.beam_search(3), max_tokens=3, name="first")
    s = ss.text(tiny)(s + ",", sampler=ss.beam_search(3), max_tokens=2, name="second")
    assert s.shape == (1, 3)
    for k in range(3):
        row = s.rows[k]
        first = next(sp for sp in row.spans if sp.name == "first")
        assert s["first"][0][k] == tiny.vocab.decode(row.tokens[first.start:first.end])


def test_captures_per_row_on_a_batch(tiny):
    s = ss.text(tiny)(["a", "b"], max_tokens=2, name="x")
    assert s["x"] == s.value and len(s["x"]) == 2


# -- chat ------------------------------------------------------------------------------------------


def template_ids(model, messages, opened=True):
    out = model.hf_tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], tokenize=True,
        add_generation_prompt=opened)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_tokens_equal_the_tokenizers_template(tiny):
    s = ss.chat(tiny).system("You are terse.").user("Name a fruit.")
    msgs = [("system", "You are terse."), ("user", "Name a fruit.")]
    assert s.token_ids[0][0] == template_ids(tiny, msgs)
    s = s.assistant("Apple.").user("Its colour?")
    msgs += [("assistant", "Apple."), ("user", "Its colour?")]
    assert s.token_ids[0][0] == template_ids(tiny, msgs)
    # no system turn: the template's default system prompt is rendered, as apply_chat_template does
    assert ss.chat(tiny).user("Hi").token_ids[0][0] == template_ids(tiny, [("user", "Hi")])


def test_a_second_turn_prefills_only_its_own_tokens(tiny):
    s = ss.chat(tiny).user("Name a fruit.")
    s = s.assistant(ss.text(tiny), max_tokens=5, name="fruit")
    turn = s.user("And its colour?")
    new = len(turn.rows[0].tokens) - len(s.rows[0].tokens)
    before = tiny.stats
    reply = turn.assistant(ss.text(tiny), max_tokens=3, name="colour")
    used = tiny.stats - before
    # the new turn's tokens, plus the first reply's last token (generated, never fed)
    assert used.prefill_tokens == new
    assert reply["fruit"] == s["fruit"] and isinstance(reply["colour"], str)
    text = tiny.vocab.decode(reply.rows[0].tokens)
    assert s["fruit"] + "<|im_end|>" in text and text.count("<|im_start|>assistant") == 2


def test_chat_states_fork_slice_and_beam(tiny):
    s = ss.chat(tiny).user("Say something.")
    forked = s.assistant(ss.text(tiny), max_tokens=3, num_samples=2,
                         sampler=ss.multinomial(), seed=0)
    nxt = forked.user("Again.")
    assert nxt.shape == (1, 2)
    for k in range(2):
        reply = forked.texts[0][k][len(str(s)):]
        assert nxt.rows[k].chat.messages[-2] == ("assistant", reply)
    # slicing back to a turn boundary keeps the conversation; inside the markup it does not
    first_end = nxt.rows[0].chat.ends[0]
    back = nxt.tokens[:first_end]
    assert back.rows[0].chat.messages == nxt.rows[0].chat.messages[:1]
    back.user("Another question.")
    with pytest.raises(ss.ChatTemplateError, match="not a conversation"):
        nxt.tokens[:first_end - 1].user("x")
    beams = s.assistant(ss.text(tiny), max_tokens=2, sampler=ss.beam_search(2), name="b")
    assert beams.shape == (1, 2) and beams.user("ok").shape == (1, 2)


def test_a_list_of_turns_branches_a_conversation(tiny):
    base = ss.chat(tiny).system("Be brief.")
    s = base.user(["Name a fruit.", "Name a colour."])
    assert s.shape == (2, 1)
    for q, ids in zip(["Name a fruit.", "Name a colour."], s.token_ids):
        assert ids[0] == template_ids(tiny, [("system", "Be brief."), ("user", q)])
    replies = s.assistant(ss.text(tiny), max_tokens=3, name="r")
    assert replies.shape == (2, 1) and len(replies["r"]) == 2
    with pytest.raises(ss.BatchMismatch):
        s.user(["a", "b", "c"])


@pytest.mark.real
def test_turns_without_a_reply_between_them_render_as_the_template_does(real):
    s = ss.chat(real).user("Name a fruit.").user("Name a colour.")
    msgs = [("user", "Name a fruit."), ("user", "Name a colour.")]
    assert s.token_ids[0][0] == template_ids(real, msgs)
    s = ss.chat(real).user("Name a fruit.").system("Be brief.")
    msgs = [("user", "Name a fruit."), ("system", "Be brief.")]
    assert s.token_ids[0][0] == template_ids(real, msgs, opened=False)
    assert s.user("Go.").token_ids[0][0] == template_ids(real, msgs + [("user", "Go.")])
    # an empty reply given on purpose is a turn
    s = ss.chat(real).user("Hi").assistant("").user("Again")
    assert s.token_ids[0][0] == template_ids(
        real, [("user", "Hi"), ("assistant", ""), ("user", "Again")])


def test_taking_back_an_unanswered_turn_keeps_the_kv(fresh_tiny):
    s = ss.chat(fresh_tiny).user("Name a fruit.")
    ss.text(fresh_tiny)(s, max_tokens=1)                    # the first turn's KV is stored
    t = s.user("Name a colour.")
    before = fresh_tiny.stats
    ss.text(fresh_tiny)(t, max_tokens=1)
    # the first user turn is not computed again
    assert (fresh_tiny.stats - before).cached_tokens_reused >= t.rows[0].chat.ends[0]


def test_a_list_of_turns_branches_every_sample(tiny):
    s = ss.text(tiny)(ss.chat(tiny).user("Say hi."), num_samples=2, max_tokens=3,
                      sampler=ss.multinomial(), seed=0)
    assert s.shape == (1, 2)
    t = s.user(["Name a fruit.", "Name a colour."])
    assert t.shape == (2, 2)
    for b, q in enumerate(["Name a fruit.", "Name a colour."]):
        for k in range(2):
            assert t.rows[b * 2 + k].chat.messages[-1] == ("user", q)
            assert t.rows[b * 2 + k].tokens[:len(s.rows[k].tokens)] == s.rows[k].tokens


def test_token_healing_keeps_the_conversation(tiny):
    s = ss.chat(tiny).user("Hi")
    r = s.assistant(ss.text(tiny), max_tokens=3, token_healing=True, name="r")
    assert r.rows[0].chat is not None
    msgs = [("user", "Hi"), ("assistant", r["r"]), ("user", "More")]
    assert r.user("More").token_ids[0][0] == template_ids(tiny, msgs)
    # healing re-spells the reply's own text, never the template's markup
    s = s.assistant("The url is http")
    healed = ss.text(tiny)(s, max_tokens=3, token_healing=True)
    assert healed.rows[0].spans[-1].start < len(s.rows[0].tokens)        # "http" was healed
    assert healed.rows[0].chat.open_at == s.rows[0].chat.open_at
    assert str(healed).startswith(str(s)) and healed.user("ok").shape == (1, 1)


def test_chat_errors(tiny):
    tok = copy.deepcopy(tiny.hf_tokenizer)
    tok.chat_template = None
    plain = ss.models.from_hf(tiny.hf_model, tok)
    with pytest.raises(ss.ChatTemplateError, match="no chat template"):
        ss.chat(plain)
    with pytest.raises(ss.ChatTemplateError, match="not a conversation"):
        ss.from_tokens(tiny, [[1, 2]]).user("hi")
    with pytest.raises(ss.ChatTemplateError, match="turn before it"):
        ss.chat(tiny).assistant("hi")
    with pytest.raises(ss.ChatTemplateError, match="rebuild"):
        (ss.chat(tiny).system("x") + " raw text").user("hi")


# -- signatures, defaults, progress ----------------------------------------------------------------


@pytest.mark.parametrize("method", ["__call__", "stream", "resume", "acall"])
def test_call_keywords_are_in_every_signature_with_calls_defaults(tiny, method):
    fn = getattr(ss.text(tiny), method)
    params = inspect.signature(fn).parameters
    fields = {f.name: f.default for f in dataclasses.fields(Call)}
    keywords = {n: p.default for n, p in params.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == fields
    assert all(params[n].annotation for n in fields)          # typed
    for name in fields:
        assert f"{name} :" in fn.__doc__


def test_the_keyword_reference_states_the_real_defaults():
    from seqstate.call import CALL_PARAMETERS, DEFAULT_MAX_TOKENS, MAX_CONSTRAINED_TOKENS
    from seqstate.engine.step import DEFAULT_MAX_BACKTRACKS

    for field in dataclasses.fields(Call):
        assert f"\n{field.name} : " in "\n" + CALL_PARAMETERS, field.name
    assert f"None: {DEFAULT_MAX_TOKENS} for free text" in CALL_PARAMETERS
    assert f"bounded by {MAX_CONSTRAINED_TOKENS} tokens" in CALL_PARAMETERS
    assert f"max_backtracks : int, default {DEFAULT_MAX_BACKTRACKS}" in CALL_PARAMETERS


def test_the_speculate_reference_says_what_holds(tiny):
    from seqstate.call import CALL_PARAMETERS

    doc = " ".join(CALL_PARAMETERS.split())
    assert "the output is the same as without it" not in doc
    assert "Greedy output is the same as with False" in doc
    assert "a seeded call with several rows may draw other samples" in doc
    gen = ss.choice(tiny, ["alpha beta gamma", "alpha delta"])
    assert gen("x").token_ids == gen("x", speculate=False).token_ids


def test_reliability_page_describes_the_scheduler():
    root = pathlib.Path(__file__).resolve().parents[1]
    page = (root / "docs/concepts/reliability.md").read_text()
    assert "serialised" not in page and "one worker thread" in page


def test_call_options_type_the_same_keywords_as_call():
    from seqstate.call import CallOptions

    typed = {k: getattr(v, "__forward_arg__", v)
             for k, v in CallOptions.__annotations__.items()}
    assert typed == {f.name: f.type for f in dataclasses.fields(Call)}


def test_foreign_keyword_still_names_seqstates_spelling(tiny):
    with pytest.raises(ss.ArgumentError, match="max_tokens="):
        ss.text(tiny)("x", max_new_tokens=3)


def test_default_max_tokens_bounds_free_text_and_constrained_calls(tiny, monkeypatch):
    import importlib
    continuous = importlib.import_module("seqstate.generation.prompts")
    eos = tuple(tiny.eos_token_ids)
    no_eos = lambda e: ss.hooks.Resample(ban=eos) if e.token in eos else None  # noqa: E731
    s = ss.text(tiny)("Go", hooks=[no_eos])
    assert len(s.rows[0].tokens) - 1 == continuous.DEFAULT_MAX_TOKENS == 256
    assert s.finish_reason == "max_tokens"
    monkeypatch.setattr(continuous, "MAX_CONSTRAINED_TOKENS", 5)
    s = ss.regex(tiny, "[a-z]*")("Go")
    assert len(s.token_ids[0][0]) - 1 <= 5 and s.finish_reason in ("max_tokens", "eos",
                                                                    "constraint_complete")


def test_progress_shows_and_can_be_silenced(tiny, capsys, monkeypatch):
    ss.text(tiny)("Go", max_tokens=5, progress=True)
    assert "tok" in capsys.readouterr().err
    ss.text(tiny)("Go", max_tokens=5, progress=False)
    ss.text(tiny)("Go", max_tokens=5)               # automatic: stderr is not a terminal here
    assert capsys.readouterr().err == ""
    ss.text(tiny)("Go", max_tokens=2, sampler=ss.beam_search(2), progress=True)
    assert "tok" in capsys.readouterr().err
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.setenv("SEQSTATE_PROGRESS", "0")
    ss.text(tiny)("Go", max_tokens=5)
    assert capsys.readouterr().err == ""
    with pytest.raises(ss.ArgumentError, match="progress"):
        ss.text(tiny)("Go", progress="yes")


# -- named-axis accessors ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (3, 1), (2, 3)])
def test_accessors_mean_the_same_on_every_shape(tiny, shape):
    b, k = shape
    base = ss.from_tokens(tiny, [[1, 2, 3, 4, 5, 6][: 3 + i] for i in range(b)])
    s = ss.text(tiny)(base, num_samples=k, max_tokens=2, sampler=ss.multinomial(), seed=0) \
        if k > 1 else base
    assert s.shape == shape and s.batch == b and s.samples == k
    assert s.tokens[:-3] == s[:, :, :-3] and s.tokens[1] == s[:, :, 1]
    assert s.samples[-1:] == s[:, -1:, :] and s.batch[0] == s[0, :, :]
    assert s.batch[0].shape == (1, k) and s.samples[0].shape == (b, 1)
    if shape == (1, 4):
        # the shortcut rule's trap: on 1xS a single key indexes samples, not tokens
        assert s[:-3].shape == (1, 1) and s.tokens[:-3].shape == (1, 4)
    with pytest.raises(ss.SlicingError):
        s.tokens.slice(slice(1, None), strict=True)
    assert repr(s.batch) == str(b) and f"{s.samples}" == str(k)


# -- sampling options vs Hugging Face's processors ----------------------------------------------


def test_sampling_options_equal_hf_logits_processors():
    from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    ids = torch.randint(0, 50, (3, 12), generator=g)
    sampler = ss.multinomial(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05,
                             repetition_penalty=1.3)
    ours = sampler.warp(logits, [(row.tolist(), 12) for row in ids])
    theirs = logits.clone()
    for proc in (RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7),
                 TopKLogitsWarper(20), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)):
        theirs = proc(ids, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = torch.isfinite(ours)
    # the same elementwise ops on the same fixed tensor (no matmul, no batch): equal here; an
    # ulp at these magnitudes (< 16) is under 1e-6, so any CPU's rounding stays within
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=0, atol=1e-6)


def test_presence_and_frequency_penalties_count_this_calls_tokens():
    logits = torch.zeros(1, 6)
    sampler = ss.multinomial(presence_penalty=0.5, frequency_penalty=0.25)
    # tokens before start (the prompt) are not penalized; 2 occurs twice, 4 once
    out = sampler.warp(logits, [([1, 1, 2, 4, 2], 2)])
    assert out.tolist() == [[0.0, 0.0, -1.0, 0.0, -0.75, 0.0]]


def test_penalties_change_what_a_real_call_draws(tiny):
    plain = ss.text(tiny)("x", max_tokens=12, sampler=ss.multinomial(temperature=0.1), seed=3)
    strict = ss.text(tiny)("x", max_tokens=12, seed=3,
                           sampler=ss.multinomial(temperature=0.1, frequency_penalty=50.0))
    new = strict.token_ids[0][0][1:]
    assert len(set(new)) == len(new)                   # a huge frequency penalty: no repeats
    assert len(set(plain.token_ids[0][0][1:])) < 12      # without it, this seed repeats
    # log-probs stay the model's own, not the penalized ones
    fresh = tiny.full_logits(strict.token_ids[0][0]).log_softmax(-1)
    for pos, (tok, lp) in enumerate(zip(new, strict.logprobs[0][0][1:])):
        assert_close(lp, fresh[pos, tok], tiny, "a sampled token's log-prob vs a fresh forward")


def test_bad_sampling_options_are_argument_errors():
    for kw in ({"min_p": 1.5}, {"repetition_penalty": 0}, {"presence_penalty": float("inf")},
               {"frequency_penalty": "a"}):
        with pytest.raises(ss.ArgumentError):
            ss.multinomial(**kw)


def test_chat_captures_accessors_and_penalties_on_every_engine(engine):
    s = ss.chat(engine).user("Name a fruit.")
    assert s.token_ids[0][0] == template_ids(engine, [("user", "Name a fruit.")])
    sampler = ss.multinomial(temperature=0.7, min_p=0.05, repetition_penalty=1.3,
                             frequency_penalty=0.5)
    s = s.assistant(ss.text(engine), max_tokens=4, num_samples=2, sampler=sampler, seed=0,
                    name="fruit")
    turn = s.user("Why?")
    before = engine.stats
    why = turn.assistant(ss.choice(engine, ["tasty", "healthy"]), name="why")
    new_turns = sum(len(t.tokens) - len(r.tokens) for t, r in zip(turn.rows, s.rows))
    assert (engine.stats - before).prefill_tokens == new_turns       # only the new turns
    assert why.shape == (1, 2) and why["fruit"] == s["fruit"]
    assert set(why["why"][0]) <= {"tasty", "healthy"}
    assert why.samples[1].tokens[:-1] == why[:, 1:2, :-1]
    engine.store.verify()
