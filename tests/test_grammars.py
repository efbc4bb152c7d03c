"""Shipped grammars compile and constrain."""

import pytest

import seqstate as ss


@pytest.mark.parametrize("name", ["arithmetic", "json", "common", "sql", "yaml"])
def test_grammar_compiles(tiny, name):
    assert name in ss.grammars.available()
    gen = ss.cfg(tiny, ss.grammars.load(name))
    assert gen.constraint.start().allowed().any()


def test_unknown_grammar_lists_the_shipped_ones():
    with pytest.raises(ss.ArgumentError, match="arithmetic"):
        ss.grammars.load("nope")


@pytest.mark.real
def test_sql_grammar_on_real_model(real):
    s = ss.cfg(real, ss.grammars.load("sql"))(
        "Write SQL that lists the names of users older than 30.\n", max_tokens=40)
    assert str(s.value or "").startswith("SELECT ") or s.finish_reason == "max_tokens"
