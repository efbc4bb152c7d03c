"""JSON-schema constraints: llguidance's grammar, then ``jsonschema`` on every finished value.

The schema is prepared (`json_prepare`) and compiled by llguidance into a grammar that
allows every valid value and, where the grammar cannot say it all, a few more; the complete
text is then validated against the original schema, and a value that fails is never parsed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import jsonschema
import llguidance

from seqstate.constraints.grammar import GrammarConstraint
from seqstate.constraints.json_formats import format_checker
from seqstate.constraints.json_lark import needs_lark, to_lark
from seqstate.constraints.json_pointer import check_refs, find_keyword, subschemas
from seqstate.constraints.json_prepare import KEY_ORDERS, Prepared, prepare
from seqstate.errors import ConstraintError

__all__ = ["JsonConstraint", "WHITESPACE", "check_options", "validator_for"]


def _uses(schema: object, keys: set[str], test=lambda value: True) -> bool:
    return any(k in node and test(node[k]) for _, node in subschemas(schema) for k in keys)


def validator_for(schema: object):
    """A ``jsonschema`` validator class for ``schema``'s draft, guessed when ``$schema`` is absent.

    Without ``$schema``, boolean ``exclusiveMinimum`` means draft 4, 2019+ keywords mean 2020-12,
    and anything else is read as draft 7 (whose ``items`` arrays and ``dependencies`` are the
    most common in the wild).
    """
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str):
        cls = jsonschema.validators.validator_for(schema, default=None)
        if cls is not None:
            return cls
    if _uses(schema, {"exclusiveMinimum", "exclusiveMaximum"}, lambda v: isinstance(v, bool)):
        return jsonschema.Draft4Validator
    if _uses(schema, {"prefixItems", "$defs", "dependentRequired", "dependentSchemas",
                      "unevaluatedProperties", "unevaluatedItems"}):
        return jsonschema.Draft202012Validator
    return jsonschema.Draft7Validator


WHITESPACE = {
    # one line, at most one space after "," and ":" (json.dumps writes either form)
    "compact": {"whitespace_flexible": False, "item_separator": ",[ ]?", "key_separator": ":[ ]?"},
    # also a newline with indentation wherever JSON allows whitespace (json.dumps(indent=...))
    "pretty": {"whitespace_pattern": r"\n[ ]*", "item_separator": ",[ ]?",
               "key_separator": ":[ ]?"},
    # any JSON whitespace anywhere: unbounded, so a weak model may spend its tokens on it
    "flexible": {"whitespace_flexible": True},
}


def check_options(whitespace: object, additional_properties: object, key_order: object) -> None:
    """Raise ``ConstraintError`` for an option value that ``JsonConstraint`` does not take."""
    if not isinstance(whitespace, str) or whitespace not in WHITESPACE:
        raise ConstraintError(f"whitespace must be one of {sorted(WHITESPACE)}, got "
                              f"{whitespace!r}")
    if not isinstance(additional_properties, bool):
        raise ConstraintError(f"additional_properties must be True or False, got "
                              f"{additional_properties!r}")
    if not isinstance(key_order, str) or key_order not in KEY_ORDERS:
        raise ConstraintError(f"key_order must be one of {list(KEY_ORDERS)}, got {key_order!r}")


def _check_patterns(schema: object) -> None:
    """Refuse patterns that ``jsonschema`` (Python's ``re``) cannot run: no value could be
    validated, so none could be returned."""
    for ptr, node in subschemas(schema):
        found = []
        if isinstance(node.get("pattern"), str):
            found.append((f"{ptr}/pattern", node["pattern"]))
        if isinstance(node.get("patternProperties"), dict):
            found += [(f"{ptr}/patternProperties", p) for p in node["patternProperties"]]
        for where, pattern in found:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConstraintError(
                    f"the JSON schema's `pattern` {pattern!r} at {where} is not a regex Python "
                    f"can check values against ({exc}); rewrite it in the common subset of "
                    "ECMAScript and Python regex syntax") from exc


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


class JsonConstraint(GrammarConstraint):
    """A JSON schema compiled by llguidance, with every complete value validated.

    ``validated`` lists what the grammar may allow too much of, which validation checks
    (keyword and JSON pointer): among them every ``oneOf``, generated as ``anyOf``.
    ``validate(text)`` is None for a valid complete value, else why not; ``parse`` raises
    ``ValueError`` for an invalid one.  Options are described in `compile.json_schema()`.

    Examples
    --------
    >>> import seqstate as ss
    >>> from seqstate.constraints.compile import json_schema
    >>> c = json_schema(ss.models.testing.tiny(), {"type": "array", "uniqueItems": True})
    >>> c.validated
    ('uniqueItems at #',)
    >>> c.validate("[1, 2]") is None, c.validate("[1, 1]")
    (True, "[1, 1] has non-unique elements (at $, schema keyword 'uniqueItems')")
    """

    def __init__(self, schema: object, model, parse: Callable[[str], object], *,
                 whitespace: str = "compact", additional_properties: bool = False,
                 key_order: str = "schema") -> None:
        check_options(whitespace, additional_properties, key_order)
        problem = check_refs(schema)
        if problem is not None:
            raise ConstraintError(f"the JSON schema's {problem}")
        self.schema = schema
        prepared = prepare(schema, additional_properties=additional_properties,
                           key_order=key_order)
        self.validated = prepared.validated
        self._origins = prepared.origins
        _check_patterns(schema)
        cls = validator_for(schema)
        self._validator = cls(schema, format_checker=format_checker(cls))
        # oneOf is generated as anyOf: exact when the branches are disjoint; where they overlap,
        # a value matching several branches fails validation (hence listed in `validated`)
        options = {**WHITESPACE[whitespace], "coerce_one_of": True}
        super().__init__("<JSON schema>", model, parse, self._grammar(prepared, options),
                         validate=self._check, describe_error=self._explain)

    @staticmethod
    def _grammar(prepared: Prepared, options: dict) -> str:
        if needs_lark(prepared.schema):        # constants this llguidance cannot quote
            return to_lark(prepared.schema, options)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(prepared.schema, defaults=options)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema is not a JSON object: {exc}") from exc

    def _check(self, text: str) -> str | None:
        try:
            value = json.loads(text, object_pairs_hook=_no_duplicates)
        except ValueError as exc:
            return f"not JSON: {exc}"
        try:
            error = jsonschema.exceptions.best_match(self._validator.iter_errors(value))
        except Exception as exc:    # noqa: BLE001 - a value that cannot be checked is not valid
            return f"cannot validate ({type(exc).__name__}: {exc})"
        if error is None:
            return None
        return f"{error.message} (at {error.json_path}, schema keyword {error.validator!r})"

    def _explain(self, error: str) -> str:
        """A ``ConstraintError`` message naming the keyword and its JSON pointer where known."""
        detail = " ".join(error.split()) or "unknown error"
        for needle, keyword, advice in _EXPLAIN:
            found = re.search(needle, detail)
            if found:
                keyword = keyword or (re.findall(r'"([^"]+)"', found.group(1)) or ["?"])[0]
                pointer = next(iter(re.findall(r"#/[^\s'\"`,)]*", detail)), None) \
                    or find_keyword(self.schema, keyword) or "#"
                pointer = self._origins.get(pointer, pointer)
                return (f"the JSON schema uses `{keyword}` at {pointer} in a way seqstate cannot "
                        f"generate ({detail}); {advice}")
        return (f"cannot compile this JSON schema: {detail}; simplify the schema, or generate its "
                "parts in separate calls")


# llguidance's compile errors: (what it says, the keyword to name, what the user can do)
_EXPLAIN = [
    (r"Unimplemented keys: \[(.*?)\]", None, "remove that keyword"),
    (r"patternProperty regexes", "patternProperties",
     "make the patterns disjoint, so that no key matches two of them"),
    (r"min/maxProperties", "minProperties",
     "make every key in `properties` required, or drop the bound"),
    (r"regex parse error", "pattern", "use a regex without lookarounds or backreferences"),
    (r"circular references", "$ref",
     "a recursive `$ref` cannot be combined with other keywords or `allOf`; inline them"),
    (r"intersection", "allOf", "simplify the schemas that `allOf` combines"),
]
