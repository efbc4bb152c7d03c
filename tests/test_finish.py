"""Finish reasons: one declared type, produced by every path that ends a call, on every engine.

Each way a call can end is driven here on purpose (a forced text, a hook, a schema, slicing),
and the reason it reports must be that `FinishReason` member itself, not a plain string that
happens to be equal; a walk of the package keeps raw strings from coming back.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import seqstate as ss
from seqstate.hooks import Replace, Resample


PACKAGE = pathlib.Path(ss.__file__).parent
R = ss.FinishReason


def reason_of(state) -> R:
    reason = state.finish_reason
    assert type(reason) is R, f"{reason!r} is a {type(reason).__name__}, not a FinishReason"
    return reason


def test_a_reason_is_its_plain_string():
    assert R.EOS == "eos" and "eos" == R.EOS and hash(R.EOS) == hash("eos")
    assert R("max_tokens") is R.MAX_TOKENS
    assert str(R.STOP) == "stop" and f"{R.STOP}" == "stop" and repr(R.STOP) == "'stop'"
    assert repr([[R.EOS, R.SLICED]]) == "[['eos', 'sliced']]"
    assert R.DEAD_END in ("dead_end", "max_backtracks")


def test_every_path_ends_with_its_member(engine):
    forced = ss.regex(engine, "ab cd")
    assert reason_of(forced("x:")) is R.CONSTRAINT_COMPLETE
    assert reason_of(forced("x:", stop_at=" c")) is R.STOP
    assert reason_of(ss.text(engine)("x:", max_tokens=1,
                                     hooks=[lambda e: None])) in (R.MAX_TOKENS, R.EOS)
    eos = min(engine.eos_token_ids)
    assert reason_of(ss.text(engine)("x:", max_tokens=4, hooks=[lambda e: Replace(eos)])) is R.EOS
    # every allowed token banned in turn: no way on
    assert reason_of(ss.regex(engine, "[ab]")("x:", hooks=[lambda e: Resample()],
                                              max_backtracks=1000)) is R.DEAD_END
    assert reason_of(ss.text(engine)("x:", max_tokens=4, hooks=[lambda e: Resample()],
                                     max_backtracks=2)) is R.MAX_BACKTRACKS
    s = forced("x:")
    assert reason_of(s[..., :-1]) is R.SLICED
    assert reason_of(ss.choice(engine, ["yes", "no"], method="score")("x:")) is R.SCORED


def test_a_value_its_schema_refuses_is_invalid(tiny):
    # the grammar allows only [1, 1], which uniqueItems (checked after the grammar) refuses
    schema = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2,
              "uniqueItems": True}
    s = ss.json(tiny, schema)("x:", max_tokens=40)
    assert reason_of(s) is R.INVALID and s.value is None


def test_the_package_names_reasons_only_through_the_type():
    # a string equal to a reason, anywhere in the package's code (docstrings, dict keys and
    # subscripts, which name fields such as vLLM's "max_tokens", aside), is a reason written
    # past the type; and every member the code names exists
    values = {m.value for m in R}
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "finish.py":
            continue
        tree = ast.parse(path.read_text())
        where = path.relative_to(PACKAGE.parent)
        aside = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                aside.add(id(node.value))
            elif isinstance(node, ast.Dict):
                aside |= {id(k) for k in node.keys if k is not None}
            elif isinstance(node, ast.Subscript):            # table["eos"]: a key, too
                aside.add(id(node.slice))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in values
                    and id(node) not in aside):
                bad.append(f"{where}:{node.lineno}: {node.value!r}")
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "FinishReason" and node.attr.isupper()):
                assert node.attr in R.__members__, f"{where}:{node.lineno}: {node.attr}"
    assert not bad, ("finish reasons written as strings (use seqstate.FinishReason):\n"
                     + "\n".join(bad))
