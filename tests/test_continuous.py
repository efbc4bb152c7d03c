"""Generators: every kind, constraints on the new suffix only, resume, errors before compute."""

import enum
import json as pyjson
import re
from typing import Literal

import pytest
from pydantic import BaseModel

import seqstate as ss


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Person(BaseModel):
    name: str
    age: int


def test_each_kind_on_tiny(tiny):
    assert re.fullmatch(r"[0-9]{1,3}", ss.regex(tiny, r"[0-9]{1,3}")("n=").value)
    assert ss.choice(tiny, ["cat", "category", "dog"])("pet:").value in {"cat", "category", "dog"}
    assert ss.choice(tiny, Literal["a", "b"])("x").value in {"a", "b"}
    assert isinstance(ss.choice(tiny, Colour)("x").value, Colour)
    person = ss.json(tiny, Person)("p:", max_tokens=200)
    if person.finish_reason == "constraint_complete":
        assert isinstance(person.value, Person)
    grammar = ss.cfg(tiny, ss.grammars.load("arithmetic"))("1+", max_tokens=20)
    assert grammar.finish_reason in {"constraint_complete", "max_tokens"}


def test_a_choice_returns_its_own_enums_members_when_another_enum_looks_the_same(tiny):
    # a notebook cell run twice defines a second class of the same name and members
    again = enum.Enum("Colour", {"RED": "red", "BLUE": "blue"})
    assert repr(again.RED) == repr(Colour.RED)
    assert isinstance(ss.choice(tiny, Colour)("x").value, Colour)
    assert isinstance(ss.choice(tiny, again)("x").value, again)
    assert isinstance(ss.choice(tiny, Colour)("x").value, Colour)


def test_prefix_options_still_work(tiny):
    gen = ss.choice(tiny, ["cat", "category"])
    seen = {gen("Which: ", sampler=ss.multinomial(), seed=i).value for i in range(12)}
    assert seen <= {"cat", "category"} and seen


def test_constraint_applies_to_new_suffix_only(tiny):
    s = ss.text(tiny)("free text:", max_tokens=5)
    n = ss.regex(tiny, r"[0-9]{2}")(s + " number ")
    assert str(n).startswith(str(s) + " number ")
    assert re.fullmatch(r"[0-9]{2}", n.value)


@pytest.mark.parametrize("make", [
    lambda m: ss.regex(m, r"[0-9]{1,4}"),
    lambda m: ss.choice(m, ["alpha", "beta"]),
    lambda m: ss.json(m, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    lambda m: ss.cfg(m, ss.grammars.load("arithmetic")),
    lambda m: ss.text(m),
])
def test_continuing_prefills_only_new_tokens_for_every_kind(fresh_tiny, make):
    gen = make(fresh_tiny)
    s = ss.text(fresh_tiny)("A prompt that is long enough to matter here", max_tokens=4)
    before = fresh_tiny.stats
    out = gen(s + " then", max_tokens=8)
    d = fresh_tiny.stats - before
    appended = len(fresh_tiny.encode(" then"))
    assert d.prefill_tokens == 1 + appended - 1
    assert d.cached_tokens_reused == len(s.token_ids[0][0]) - 1
    assert out.shape == (1, 1)


def test_resume_continues_the_constraint_where_the_state_stands(tiny):
    gen = ss.regex(tiny, r"[a-c]{6}")
    s = gen("letters: ")
    assert s.finish_reason == "constraint_complete"
    back = s[..., :-3]
    resumed = gen.resume(back)
    assert resumed.finish_reason == "constraint_complete"
    assert re.fullmatch(r"[a-c]{6}", resumed.value)
    assert str(resumed).startswith(str(back))


@pytest.mark.parametrize("make, max_tokens", [
    (lambda m: ss.regex(m, r"[0-9]{1,3}"), 1),
    (lambda m: ss.choice(m, ["07", "0789"]), 2),
    (lambda m: ss.json(m, {"type": "integer", "minimum": 0, "maximum": 999}), 1),
    (lambda m: ss.cfg(m, "start: /[0-9]{1,3}/"), 1),
], ids=["regex", "choice", "json", "cfg"])
def test_a_call_cut_by_max_tokens_has_no_value(tiny, make, max_tokens):
    gen = make(tiny)
    s = gen("n=", max_tokens=max_tokens, name="n")
    # the cut text already matches (the cursor accepts) but the constraint could go on
    assert s.rows[0].cursors[-1].accepting and not s.rows[0].cursors[-1].complete
    assert s.finish_reason == "max_tokens"
    assert s.value is None and s["n"] is None
    done = gen.resume(s)
    assert done.finish_reason == "constraint_complete" and done.value is not None


def test_constraint_errors_at_construction(tiny):
    with pytest.raises(ss.ConstraintError):
        ss.regex(tiny, r"([a-z")
    with pytest.raises(ss.ConstraintError, match="at least one"):
        ss.choice(tiny, [])
    with pytest.raises(ss.ConstraintError, match="duplicate"):
        ss.choice(tiny, ["a", "a"])
    with pytest.raises(ss.ConstraintError, match="must be str"):
        ss.choice(tiny, ["a", 3])
    with pytest.raises(ss.ConstraintError, match="not valid JSON"):
        ss.json(tiny, "{not json")
    with pytest.raises(ss.ConstraintError, match="invalid Lark"):
        ss.cfg(tiny, "start: undefined_rule")
    with pytest.raises(ss.ConstraintError):
        ss.json(tiny, 42)


def test_bad_calls_fail_before_compute(fresh_tiny):
    gen = ss.text(fresh_tiny)
    before = fresh_tiny.stats
    with pytest.raises(ss.ContextOverflowError, match="context of 2048"):
        gen("x", max_tokens=5000)
    with pytest.raises(ValueError, match="max_tokens"):
        gen("x", max_tokens=0)
    with pytest.raises(TypeError, match="prompt"):
        gen(42)
    with pytest.raises(ValueError, match="stop_at"):
        gen("x", stop_at=[""])
    assert (fresh_tiny.stats - before).forward_calls == 0


def test_empty_prompt_starts_from_bos(tiny):
    s = ss.text(tiny)("", max_tokens=2)
    assert s.token_ids[0][0][0] == tiny.start_token_ids[0]


def test_continuous_with_output_types(tiny):
    assert ss.continuous(tiny, Literal["yes", "no"])("ok? ").value in {"yes", "no"}
    assert re.fullmatch(r"-?(0|[1-9][0-9]*)", ss.continuous(tiny, int)("n: ", max_tokens=6).value or "0")


def test_stop_at_keeps_stop_in_state_not_in_value(tiny):
    s = ss.text(tiny)("go", max_tokens=40)
    free = s.value
    stop = free[4:6]
    cut = ss.text(tiny)("go", max_tokens=40, stop_at=stop)
    assert cut.finish_reason == "stop"
    assert cut.value == free[: free.index(stop)]
    assert str(cut).endswith(stop)


@pytest.mark.real
def test_mixed_program_on_real_model(real):
    text, yes_no, person = ss.text(real), ss.choice(real, ["yes", "no"]), ss.json(real, Person)
    s = text("Q: name a famous scientist.\nA:", max_tokens=12, stop_at="\n")
    s = yes_no(s + "Is that person alive? Answer yes or no: ")
    s = person(s + "\nThe scientist as JSON: ", max_tokens=60)
    assert s.finish_reason == "constraint_complete"
    assert isinstance(s.value, Person)
    assert Person.model_validate(pyjson.loads(str(s).split("as JSON: ")[1])) == s.value


@pytest.mark.real
def test_three_by_three_sliced_every_way(real):
    s = ss.text(real)(["Red", "Green", "Blue"], num_samples=3, sampler=ss.multinomial(), seed=0, max_tokens=5)
    assert s.shape == (3, 3)
    assert s[0:2].shape == (2, 3) and s[0:2, 1:3].shape == (2, 2) and s[1, 2].shape == (1, 1)
    assert s[::-1, ::2].shape == (3, 2) and s[-1].texts[0] == s.texts[-1]
    assert s[..., :-2].token_ids[1][1] == s.token_ids[1][1][:-2]
    one = s[2, 1]
    assert one[:3].token_ids == [[s.token_ids[2][1][:3]]]
    before = real.stats
    more = ss.text(real)(s[..., :-2], max_tokens=2)
    assert more.shape == (3, 3)
    assert (real.stats - before).prefill_tokens <= 9          # only the last kept token of each row


@pytest.mark.real
def test_non_ascii_choice_and_regex(real):
    assert ss.choice(real, ["café", "naïve"])("French word: ").value in {"café", "naïve"}
    v = ss.regex(real, r"[àéèü]{2}x")("Accents: ").value
    assert re.fullmatch(r"[àéèü]{2}x", v)


@pytest.mark.real
def test_wraps_outlines_generator(real):
    import outlines

    om = outlines.from_transformers(real.hf_model, real.hf_tokenizer)
    wrapped = ss.continuous(outlines.Generator(om, Literal["yes", "no"]))
    s = wrapped("Is the sky blue? Answer: ")
    assert s.value in {"yes", "no"}
    again = ss.continuous(outlines.Generator(om, None))(s + " Because", max_tokens=5)
    assert again.model is s.model


def test_continuous_with_outlines_terms(tiny):
    from outlines.types import Regex

    assert re.fullmatch(r"[0-9]{2}", ss.continuous(tiny, Regex(r"[0-9]{2}"))("n=").value)
    assert ss.continuous(tiny, bool)("flag: ").value in ("true", "false")
