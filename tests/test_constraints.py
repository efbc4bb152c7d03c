"""Constraints allow every string of their language, and nothing else ."""

import itertools
import re

import interegular
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import seqstate as ss
from seqstate.hooks import Replace

ALTERNATIONS = [
    ("choice", ["cat", "catalog"]),
    ("choice", ["no", "not sure"]),
    ("regex", "(a|ab)"),
    ("regex", "1|12"),
    ("regex", "(cat|catalog)s?"),
]


def generator(model, kind, spec):
    return ss.choice(model, spec) if kind == "choice" else ss.regex(model, spec)


def members(kind, spec):
    """The finite language of a choice or regex: interegular lists a regex's, `re` agrees."""
    if kind == "choice":
        return set(spec)
    found = {"".join(chars) for chars in interegular.parse_pattern(spec).to_fsm().strings()}
    assert found and all(re.fullmatch(spec, m) for m in found)
    return found


class Force:
    """Replaces each sampled token by the next token of ``target``, then by EOS."""

    def __init__(self, target, eos):
        self.target, self.eos = list(target), eos

    def __call__(self, event):
        k = len(event.generated)
        return Replace(self.target[k] if k < len(self.target) else self.eos)


@pytest.mark.parametrize("kind,spec", ALTERNATIONS, ids=[str(s) for _, s in ALTERNATIONS])
def test_every_member_is_reachable_token_by_token(tiny, kind, spec):
    gen = generator(tiny, kind, spec)
    for member in members(kind, spec):
        # the tokenizer's own spelling, e.g. "catalog" as its single token
        s = gen("Say: ", hooks=[Force(tiny.encode(member), min(tiny.eos_token_ids))], max_tokens=12)
        assert s.value == member
        assert s.finish_reason == "constraint_complete"


@pytest.mark.parametrize("kind,spec", ALTERNATIONS, ids=[str(s) for _, s in ALTERNATIONS])
def test_sampling_reaches_every_member(tiny, kind, spec):
    s = generator(tiny, kind, spec)("Say: ", num_samples=300, max_tokens=12,
                                    sampler=ss.multinomial(temperature=50.0), seed=0)
    assert set(s.value[0]) == members(kind, spec)


def test_real_model_can_choose_the_longer_option(real):
    gen = ss.choice(real, ["no", "not sure"])
    eos = min(real.eos_token_ids)
    s = gen("Are you sure? Answer: ", hooks=[Force(real.encode("not sure"), eos)])
    assert s.value == "not sure"


# -- property: sampled language == re.fullmatch language, for random small regexes ------------
ALPHABET = "ab"
LENGTH_BOUND = 4


def regexes():
    atom = st.sampled_from(list(ALPHABET))
    def extend(inner):
        return st.one_of(
            st.tuples(inner, inner).map(lambda p: p[0] + p[1]),
            st.tuples(inner, inner).map(lambda p: f"({p[0]}|{p[1]})"),
            inner.map(lambda r: f"({r})?"),
            inner.map(lambda r: f"({r}){{1,2}}"),
        )
    return st.recursive(atom, extend, max_leaves=4)


def language(pattern):
    return {"".join(p) for n in range(0, LENGTH_BOUND * 4 + 1) for p in itertools.product(ALPHABET, repeat=n)
            if re.fullmatch(pattern, "".join(p))}


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(pattern=regexes())
def test_sampled_strings_equal_the_regex_language(tiny, pattern):
    lang = language(pattern)
    if len(lang) > 12 or max(map(len, lang)) > LENGTH_BOUND:
        return                  # keep the space small
    gen = ss.regex(tiny, pattern)
    seen = set()
    for seed in range(8):                     # sample until every member was drawn (or give up)
        s = gen("x", num_samples=200, max_tokens=LENGTH_BOUND + 2,
                sampler=ss.multinomial(temperature=50.0), seed=seed)
        finished = [v for v, why in zip(s.value[0], s.finish_reason[0]) if why != "max_tokens"]
        assert set(finished) <= lang, f"{pattern!r} produced {set(finished) - lang}"
        seen |= set(finished)
        if seen == lang:
            break
    assert seen == lang, f"{pattern!r}: never sampled {lang - seen}"


@pytest.mark.parametrize("pattern", ["[ab]*", "(ab)?", "a|", "(a|ab)?", "(b{1,2})?"])
def test_patterns_matching_the_empty_string_compile_and_allow_it(tiny, pattern):
    gen = ss.regex(tiny, pattern)
    cursor = gen.constraint.start()
    assert cursor.accepting                              # "" is in the language
    s = gen("x", hooks=[Force([], min(tiny.eos_token_ids))])
    assert s.value == "" and s.finish_reason == "constraint_complete"
    s = gen("x", num_samples=100, max_tokens=4, sampler=ss.multinomial(temperature=50.0), seed=0)
    assert all(re.fullmatch(pattern, v) for v, why in zip(s.value[0], s.finish_reason[0])
               if why != "max_tokens")


def test_nested_repetition_is_refused_before_compiling(fresh_tiny):
    with pytest.raises(ss.ConstraintError, match="product"):
        ss.regex(fresh_tiny, r"(a{500}){500}")
    with pytest.raises(ss.ConstraintError, match="unrolls"):
        ss.regex(fresh_tiny, "(" + "|".join(f"x{i}[a-z]{{900}}" for i in range(60)) + ")")
    assert fresh_tiny.constraint_cache.get(("regex", r"(a{500}){500}")) is None
