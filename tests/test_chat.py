"""Chat: turns rendered by the tokenizer's own template, on every engine; replies, forks,
slices and beams keep the conversation; each turn prefills only its own tokens."""

import copy

import pytest

import seqstate as ss

from conftest import assert_greedy, prefill_slack


def template_ids(model, messages, opened=True):
    """The token ids ``apply_chat_template`` renders for ``messages`` (role, content)."""
    out = model.hf_tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], tokenize=True,
        add_generation_prompt=opened)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_tokens_equal_the_tokenizers_template(engine):
    s = ss.chat(engine).system("You are terse.").user("Name a fruit.")
    msgs = [("system", "You are terse."), ("user", "Name a fruit.")]
    assert s.token_ids[0][0] == template_ids(engine, msgs)
    s = s.assistant("Apple.").user("Its colour?")
    msgs += [("assistant", "Apple."), ("user", "Its colour?")]
    assert s.token_ids[0][0] == template_ids(engine, msgs)
    # no system turn: the template's default system prompt is rendered, as apply_chat_template does
    assert ss.chat(engine).user("Hi").token_ids[0][0] == template_ids(engine, [("user", "Hi")])


def test_a_reply_is_the_references_greedy_text_after_the_template(engine, reference):
    """A reply continues the template's tokens as plain greedy text would (on the server, as
    the HF engine does on its weights)."""
    s = ss.chat(engine).system("Be brief.").user("Name a planet.")
    reply = s.assistant(ss.text(engine), max_tokens=8, name="planet")
    assert reply.token_ids[0][0][:len(s.rows[0].tokens)] == \
        template_ids(engine, [("system", "Be brief."), ("user", "Name a planet.")])
    assert_greedy(reference, reply)


def test_a_second_turn_prefills_only_its_own_tokens(engine):
    sampler = ss.multinomial(temperature=0.7)
    s = ss.chat(engine).user("Name a fruit.")
    s = s.assistant(ss.text(engine), max_tokens=4, num_samples=2, sampler=sampler, seed=0,
                    name="fruit")
    turn = s.user("And its colour?")
    new = sum(len(t.tokens) - len(r.tokens) for t, r in zip(turn.rows, s.rows))
    before = engine.stats
    reply = turn.assistant(ss.choice(engine, ["red", "yellow", "green"]), name="colour")
    used = engine.stats - before
    # the new turns' tokens, plus each first reply's last token (generated, never fed); a
    # server's prefix cache reuses whole blocks only
    assert new <= used.prefill_tokens <= new + len(s.rows) * prefill_slack(engine)
    assert reply["fruit"] == s["fruit"] and set(reply["colour"][0]) <= {"red", "yellow", "green"}
    text = engine.vocab.decode(reply.rows[0].tokens)
    assert s["fruit"][0][0] + "<|im_end|>" in text
    assert text.count("<|im_start|>assistant") == 2


def test_chat_states_fork_slice_and_beam(engine):
    s = ss.chat(engine).user("Say something.")
    forked = s.assistant(ss.text(engine), max_tokens=3, num_samples=2,
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
    beams = s.assistant(ss.text(engine), max_tokens=2, sampler=ss.beam_search(2), name="b")
    assert beams.shape == (1, 2) and beams.user("ok").shape == (1, 2)


def test_a_list_of_turns_branches_a_conversation(engine):
    base = ss.chat(engine).system("Be brief.")
    s = base.user(["Name a fruit.", "Name a colour."])
    assert s.shape == (2, 1)
    for q, ids in zip(["Name a fruit.", "Name a colour."], s.token_ids):
        assert ids[0] == template_ids(engine, [("system", "Be brief."), ("user", q)])
    replies = s.assistant(ss.text(engine), max_tokens=3, name="r")
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


def test_taking_back_an_unanswered_turn_keeps_the_kv(engine):
    s = ss.chat(engine).user("Name a fruit.")
    ss.text(engine)(s, max_tokens=1)                        # the first turn's KV is stored
    t = s.user("Name a colour.")
    before = engine.stats
    ss.text(engine)(t, max_tokens=1)
    # the first user turn is not computed again (a server reuses whole blocks of it)
    reused = (engine.stats - before).cached_tokens_reused
    assert reused >= t.rows[0].chat.ends[0] - prefill_slack(engine)


def test_a_list_of_turns_branches_every_sample(engine):
    s = ss.text(engine)(ss.chat(engine).user("Say hi."), num_samples=2, max_tokens=3,
                        sampler=ss.multinomial(), seed=0)
    assert s.shape == (1, 2)
    t = s.user(["Name a fruit.", "Name a colour."])
    assert t.shape == (2, 2)
    for b, q in enumerate(["Name a fruit.", "Name a colour."]):
        for k in range(2):
            assert t.rows[b * 2 + k].chat.messages[-1] == ("user", q)
            assert t.rows[b * 2 + k].tokens[:len(s.rows[k].tokens)] == s.rows[k].tokens


def test_token_healing_keeps_the_conversation(engine):
    s = ss.chat(engine).user("Hi")
    r = s.assistant(ss.text(engine), max_tokens=3, token_healing=True, name="r")
    assert r.rows[0].chat is not None
    msgs = [("user", "Hi"), ("assistant", r["r"]), ("user", "More")]
    assert r.user("More").token_ids[0][0] == template_ids(engine, msgs)
    # healing re-spells the reply's own text, never the template's markup
    s = s.assistant("The url is http")
    healed = ss.text(engine)(s, max_tokens=3, token_healing=True)
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
