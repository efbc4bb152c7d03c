"""Turning user specs (regex, options, JSON schema, Lark) into cached compiled constraints."""

from __future__ import annotations

import enum
import json
import re
import re._constants as _sre
import re._parser as _parser
import typing
from collections.abc import Callable, Sequence
from typing import Any

import pydantic

from seqstate.constraints.grammar import GrammarConstraint
from seqstate.constraints.json_constraint import JsonConstraint, check_options
from seqstate.constraints.regex_constraint import RegexConstraint, escape
from seqstate.errors import ConstraintError

__all__ = ["regex", "choice", "json_schema", "cfg", "escape", "options_of"]


def _cached(model, key: tuple, build: Callable[[], Any]) -> Any:
    cache = model.constraint_cache
    if key not in cache:
        cache[key] = build()
    return cache[key]


MAX_PATTERN_CHARS = 20_000
MAX_REPEAT = 1_000          # the largest product of nested repetition bounds
MAX_EXPANDED = 50_000       # character positions of the regex with repetitions unrolled


def _expanded_size(nodes, factor: int, pattern: str) -> int:
    """Character positions of parsed regex ``nodes`` with every bounded repetition unrolled.

    ``factor`` is the product of the enclosing repetition bounds; it alone is checked against
    ``MAX_REPEAT``, because the automaton's size grows with the product, not with each bound.
    """
    size = 0
    for op, arg in nodes:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = arg
            bound = lo + 1 if hi == _sre.MAXREPEAT else hi
            if factor * bound > MAX_REPEAT:
                raise ConstraintError(
                    f"nested repetitions in {_short(pattern)} repeat {factor * bound} times in "
                    f"all (the product of their bounds), more than {MAX_REPEAT}; lower the "
                    "bounds, or generate the parts in separate calls or with a grammar (ss.cfg)")
            size += bound * _expanded_size(sub, factor * bound, pattern)
        elif name == "SUBPATTERN":
            size += _expanded_size(arg[-1], factor, pattern)
        elif name == "BRANCH":
            size += sum(_expanded_size(alt, factor, pattern) for alt in arg[1])
        elif name in ("ASSERT", "ASSERT_NOT", "ATOMIC_GROUP"):
            size += _expanded_size(arg[-1] if name != "ATOMIC_GROUP" else arg, factor, pattern)
        elif name != "AT":
            size += 1
    return size


def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 60 else pattern[:57] + "...")


def _check_size(pattern: str, max_chars: int = MAX_PATTERN_CHARS) -> None:
    """Refuse regexes whose automaton would be huge, before compiling anything.

    Compiling cannot be interrupted once it starts, so the bound is decided from the parsed
    pattern: its length, the product of nested repetition bounds and the unrolled size.
    """
    if len(pattern) > max_chars:
        raise ConstraintError(f"regex of {len(pattern)} characters exceeds {max_chars}; "
                              "split the task into several calls or use a grammar (ss.cfg)")
    try:
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return                  # not Python syntax; outlines_core reports its own errors
    size = _expanded_size(parsed, 1, pattern)
    if size > MAX_EXPANDED:
        raise ConstraintError(f"regex {_short(pattern)} unrolls to {size} character positions, "
                              f"more than {MAX_EXPANDED}; lower its repetition bounds, split it "
                              "over several calls or use a grammar (ss.cfg)")


def regex(model, pattern: str) -> RegexConstraint:
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError(f"expected a non-empty regex string, got {pattern!r}")
    _check_size(pattern)
    return _cached(model, ("regex", pattern), lambda: RegexConstraint(pattern, model))


def options_of(spec: Any) -> tuple[list[str], list[Any]]:
    """``(texts, values)`` of a choice spec: a list of str, a ``Literal[...]`` or an ``Enum``."""
    if isinstance(spec, type) and issubclass(spec, enum.Enum):
        values = list(spec)
        texts = [str(v.value) for v in values]
    elif typing.get_origin(spec) is typing.Literal:
        values = list(typing.get_args(spec))
        texts = [str(v) for v in values]
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        values = list(spec)
        if not all(isinstance(v, str) for v in values):
            bad = next(v for v in values if not isinstance(v, str))
            raise ConstraintError(f"choice options must be str, got {bad!r} "
                                  f"({type(bad).__name__}); convert the options to strings")
        texts = values
    else:
        raise ConstraintError(f"expected a list of str, a Literal[...] or an Enum, got {spec!r}")
    if not texts:
        raise ConstraintError("choice needs at least one option, got an empty list")
    dupes = sorted({t for t in texts if texts.count(t) > 1})
    if dupes:
        raise ConstraintError(f"duplicate choice options {dupes}; each option must be unique")
    if any(t == "" for t in texts):
        raise ConstraintError("an empty string cannot be a choice option")
    return texts, values


def choice(model, spec: Any) -> RegexConstraint:
    texts, values = options_of(spec)
    by_text = dict(zip(texts, values))
    pattern = "(" + "|".join(escape(t) for t in texts) + ")"
    # enum members keyed by themselves: two enums alike in name and members (a notebook cell
    # run twice) have equal reprs, and each call must get its own class's members back
    key = tuple(v if isinstance(v, enum.Enum) else repr(v) for v in values)
    return _cached(model, ("choice", tuple(texts), key),
                   lambda: RegexConstraint(pattern, model, parse=by_text.__getitem__))


def _schema_of(spec: Any) -> tuple[object, str, Callable[[str], Any], object]:
    """``(schema, schema text, parse, cache key part)`` of a JSON-schema spec."""
    if isinstance(spec, type) and issubclass(spec, pydantic.BaseModel):
        schema = spec.model_json_schema()
        return schema, json.dumps(schema), spec.model_validate_json, spec
    if isinstance(spec, (dict, bool)):
        try:
            text = json.dumps(spec)
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"the JSON schema dict is not JSON: {exc}") from exc
        return spec, text, json.loads, None
    if isinstance(spec, str):
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema string is not valid JSON: {exc}") from exc
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"a JSON schema is an object (or true/false), got "
                                  f"{type(schema).__name__} {_short(spec)}")
        return schema, spec, json.loads, None
    raise ConstraintError(f"expected a pydantic model class, a dict or a JSON-schema string, "
                          f"got {type(spec).__name__}")


def json_schema(model, spec: Any, *, whitespace: str = "compact",
                additional_properties: bool = False, key_order: str = "schema") -> JsonConstraint:
    """A compiled JSON-schema constraint (llguidance), cached per schema and options.

    Parameters
    ----------
    spec : pydantic model class, dict or str
        The schema; a pydantic model's values parse into instances, the others into JSON.
    whitespace : {"compact", "pretty", "flexible"}
        At most one space after "," and ":" on one line; also newlines with indentation;
        any JSON whitespace.
    additional_properties : bool
        False closes object schemas that list ``properties`` without saying whether other
        keys are allowed (see ``json_prepare.prepare``); True follows the JSON Schema default.
    key_order : {"schema", "required_first"}
        Properties in the schema's order, or the required ones first.
    """
    check_options(whitespace, additional_properties, key_order)
    schema, text, parse, owner = _schema_of(spec)
    key = ("json", text, owner, whitespace, additional_properties, key_order)
    return _cached(model, key, lambda: JsonConstraint(
        schema, model, parse, whitespace=whitespace, additional_properties=additional_properties,
        key_order=key_order))


def cfg(model, lark: str) -> GrammarConstraint:
    if not isinstance(lark, str) or not lark.strip():
        raise ConstraintError("expected Lark grammar text (see ss.grammars.load), got "
                              f"{type(lark).__name__}")
    return _cached(model, ("cfg", lark), lambda: GrammarConstraint(lark, model))
