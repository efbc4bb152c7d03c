"""JSON schemas on llguidance: the cursor contract, options, formats, validation, errors."""

import json
import re
from typing import Literal, Optional

import jsonschema
import pytest
import torch
from pydantic import BaseModel, Field

import seqstate as ss
from seqstate.constraints import compile as compiled
from seqstate.constraints.json_formats import FORMATS, format_checker
from seqstate.constraints.json_lark import LLGUIDANCE_QUOTES_LONG_CONSTANTS
from seqstate.constraints.json_prepare import prepare

HOT = ss.multinomial(temperature=1.5)
OBJECT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}


@pytest.fixture(autouse=True)
def one_thread():
    """Many short decode steps of a tiny model: one torch thread avoids thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Person(BaseModel):
    name: str
    age: int


def accepts(constraint, text: str) -> bool:
    """Whether ``text``, tokenized as the model would, is a complete match token by token."""
    cursor = constraint.start()
    for token in constraint.model.encode(text):
        if not cursor.allowed()[token]:
            return False
        cursor = cursor.advance(token)
    return cursor.accepting


def generated(state, prompt: str) -> list[str]:
    """The generated text of every row of a 1xS state."""
    assert all(t.startswith(prompt) for t in state.texts[0])
    return [t[len(prompt):] for t in state.texts[0]]


def test_value_is_parsed_as_before(tiny):
    person = ss.json(tiny, Person)("p:", max_tokens=80, sampler=HOT, seed=3, num_samples=4)
    for reason, value in zip(person.finish_reason[0], person.value[0]):
        if reason == "constraint_complete":
            assert isinstance(value, Person)
    s = ss.json(tiny, OBJECT)("p:", max_tokens=80, sampler=HOT, seed=3, num_samples=4)
    done = [v for r, v in zip(s.finish_reason[0], s.value[0]) if r == "constraint_complete"]
    assert done and all(isinstance(v, dict) and set(v) == {"name", "age"} for v in done)
    as_text = compiled.json_schema(tiny, json.dumps(OBJECT))
    assert as_text.parse('{"name": "Al", "age": 1}') == {"name": "Al", "age": 1}


def test_first_tokens_open_the_object_and_eos_waits_for_a_complete_value(tiny):
    c = compiled.json_schema(tiny, OBJECT)
    start = c.start()
    allowed = start.allowed().nonzero().flatten().tolist()
    assert allowed and all(tiny.vocab.decode([t]).startswith("{") for t in allowed)
    assert not start.accepting and not any(start.allowed()[e] for e in tiny.eos_token_ids)
    cursor = start
    for token in tiny.encode('{"name": "Ann", "age": 7}'):
        cursor = cursor.advance(token)
    assert cursor.accepting and cursor.complete


def test_forks_are_independent_and_the_parent_is_unchanged(tiny):
    c = compiled.json_schema(tiny, OBJECT)
    base = c.start().advance(tiny.encode('{"')[0])
    before = base.allowed().clone()
    a = base.advance(tiny.encode("name")[0])
    b = base.advance(tiny.encode("n")[0])
    assert not a.allowed().equal(b.allowed())
    assert base.allowed().equal(before)
    with pytest.raises(ss.ConstraintError):
        base.advance(tiny.encode("]")[0])
    assert base.allowed().equal(before)                        # a refused token changes nothing


def test_one_token_from_one_cursor_gives_one_cursor_while_it_lives(tiny):
    c = compiled.json_schema(tiny, OBJECT)
    start = c.start().advance(tiny.encode('{"')[0])
    first, second = tiny.encode("name")[0], tiny.encode("n")[0]
    a = start.advance(first)
    assert start.advance(first) is a                   # its mask is computed once, not twice
    b = start.advance(second)
    assert b is not a and not b.allowed().equal(a.allowed())
    mask = a.allowed().clone()
    del a
    again = start.advance(first)                       # after another token: a cursor anew
    assert again.allowed().equal(mask) and start.advance(first) is again


def test_rows_that_walk_one_path_share_its_cursors(tiny):
    s = ss.json(tiny, OBJECT)(["Person:", "Someone else:", "X", "Y"], max_tokens=8)
    made = [(r.tokens[r.last_span.start:], r.cursors[r.last_span.start:]) for r in s.rows]
    shared = 0
    for tokens_a, cursors_a in made:
        for tokens_b, cursors_b in made:
            for k, (ca, cb) in enumerate(zip(cursors_a, cursors_b)):
                if ca is cb:                           # shared only where the paths agree
                    assert tokens_a[: k + 1] == tokens_b[: k + 1]
                    shared += 1
    assert len({id(cursors[0]) for _, cursors in made}) == 1   # the forced '{' of every row
    assert shared > len(made) ** 2


def test_slicing_back_and_resuming_finishes_a_valid_value(tiny):
    bounded = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
    gen = ss.json(tiny, bounded)
    prompt = "Person: "
    s = gen(prompt, max_tokens=60, sampler=HOT, seed=5, num_samples=4)
    done = [j for j, r in enumerate(s.finish_reason[0]) if r == "constraint_complete"]
    assert done
    row = s[0, done[0], :]
    finished = 0
    for k in (1, 3, 6):
        back = row[..., :-k]
        resumed = gen.resume(back, max_tokens=40, sampler=HOT, seed=k)
        assert str(resumed).startswith(str(back))
        if resumed.finish_reason == "constraint_complete":          # a 1x1 state: one row
            finished += 1
            text = generated(resumed, prompt)[0]
            assert gen.constraint.validate(text) is None
            assert resumed.value == json.loads(text)
    assert finished


def test_non_ascii_strings_are_byte_exact(tiny):
    schema = {"type": "object", "properties": {
        "word": {"enum": ["café", "naïve", "日本語", "🙂"]},
        "accent": {"type": "string", "pattern": "^[éèàü]{2,5}$"}},
        "required": ["word", "accent"]}
    gen = ss.json(tiny, schema)
    s = gen("x", max_tokens=60, sampler=HOT, seed=0, num_samples=8)
    done = [v for r, v in zip(s.finish_reason[0], s.value[0]) if r == "constraint_complete"]
    assert done
    for value in done:
        assert value["word"] in {"café", "naïve", "日本語", "🙂"}
        assert re.fullmatch("[éèàü]{2,5}", value["accent"])
    assert accepts(gen.constraint, '{"word": "日本語", "accent": "éü"}')
    assert not accepts(gen.constraint, '{"word": "cafe", "accent": "éü"}')


SHORT_CONST = 'a "b"\nc'
LONG_CONST = 'She said "hello"\nand then left the building without a word.'


class Note(BaseModel):
    kind: Literal[LONG_CONST]
    mark: Literal[SHORT_CONST]
    n: int = Field(ge=0, le=99)


class Notes(BaseModel):
    notes: list[Note]
    tag: Optional[Literal[LONG_CONST, "other"]] = None


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("style, dump", [
    ("compact", compact), ("pretty", lambda v: json.dumps(v, ensure_ascii=False, indent=2)),
    ("flexible", lambda v: json.dumps(v, ensure_ascii=False)),
])
def test_constants_with_quotes_and_newlines_of_any_length_are_generated(tiny, style, dump):
    note = {"kind": LONG_CONST, "mark": SHORT_CONST, "n": 3}
    cases = [({"const": SHORT_CONST}, SHORT_CONST), ({"const": LONG_CONST}, LONG_CONST),
             ({"enum": [LONG_CONST, "x"]}, LONG_CONST), (Note, note),
             (Notes, {"notes": [note, note], "tag": LONG_CONST}), (Notes, {"notes": []})]
    for schema, value in cases:
        c = compiled.json_schema(tiny, schema, whitespace=style)
        assert accepts(c, dump(value)), (schema, style)
        assert c.validate(dump(value)) is None
        if "word" in dump(value):
            assert not accepts(c, dump(value).replace("word", "wood"))
    # ss.choice compiles options as a regex (outlines_core): it never had the problem
    assert accepts(compiled.choice(tiny, Literal[LONG_CONST, SHORT_CONST]), LONG_CONST)


@pytest.mark.real
def test_long_constants_are_generated_by_a_real_model(real):
    s = ss.json(real, Note)("A note as JSON: ", max_tokens=80)
    assert s.finish_reason == "constraint_complete"
    assert s.value.kind == LONG_CONST and s.value.mark == SHORT_CONST
    s = ss.json(real, {"const": LONG_CONST})("Say it: ", max_tokens=40)
    assert s.finish_reason == "constraint_complete" and s.value == LONG_CONST


@pytest.mark.skipif(LLGUIDANCE_QUOTES_LONG_CONSTANTS, reason="this llguidance quotes them itself")
def test_a_long_constant_that_cannot_be_worked_around_is_refused(tiny):
    schema = {"type": "array", "items": {"const": LONG_CONST}, "minItems": 2}
    with pytest.raises(ss.ConstraintError, match=r"at # leads to a string constant.*>= 1\.7\.2"):
        ss.json(tiny, schema)


def test_issue_examples_generate_valid_values(tiny):
    """Schemas that an earlier regex compilation got wrong, each with its language checked."""
    schemas = [
        {"type": "array", "properties": {"a": {"type": "integer"}}, "maxItems": 3},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
        {"type": "number", "minimum": -4e4640},
        {"type": "integer", "minimum": 10, "maximum": 20},
        {"type": "string", "pattern": "^[a-c]+$", "minLength": 2, "maxLength": 4},
        {"type": "object", "properties": {"any": {}}, "required": ["any"]},
    ]
    for i, schema in enumerate(schemas):
        gen = ss.json(tiny, schema)
        s = gen("v:", max_tokens=40, sampler=HOT, seed=i, num_samples=8)
        finished = 0
        for text, reason in zip(generated(s, "v:"), s.finish_reason[0]):
            if reason == "constraint_complete":
                finished += 1
                jsonschema.validate(json.loads(text), schema)
        assert finished, schema


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_formats_generate_values_their_checker_accepts(tiny, name):
    # the length bound makes the random model finish; llguidance intersects it with the format
    gen = ss.json(tiny, {"type": "string", "format": name, "maxLength": 40})
    s = gen("v:", max_tokens=50, sampler=HOT, seed=1, num_samples=4)
    checker = format_checker(jsonschema.Draft202012Validator)
    done = [v for r, v in zip(s.finish_reason[0], s.value[0]) if r == "constraint_complete"]
    assert done
    for value in done:
        assert checker.conforms(value, name), (name, value)


@pytest.mark.parametrize("name, good, bad", [
    ("date", "2024-02-29", "2023-02-29"),
    ("date-time", "1999-12-31T23:59:59.5+01:00", "1999-12-31 23:59:59"),
    ("time", "08:30:00Z", "8:30"),
    ("ipv4", "192.168.0.1", "192.168.0.256"),
    ("ipv6", "fe80::1", "fe80:::1"),
    ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000"),
    ("uri", "https://example.org/a?b=c#d", "example.org/a"),
    ("email", "a.b@example.org", "a@@b"),
    ("hostname", "example.org", "-bad-.org"),
    ("duration", "P1Y2M3DT4H", "P1H"),
    ("uri-reference", "../a/b?c", "a b"),
    ("json-pointer", "/a~1b/0", "a/b"),
    ("byte", "aGk=", "aGk"),
])
def test_enforced_formats_accept_and_refuse_like_their_rfc(tiny, name, good, bad):
    c = compiled.json_schema(tiny, {"type": "string", "format": name})
    assert accepts(c, json.dumps(good)) and c.validate(json.dumps(good)) is None
    assert not accepts(c, json.dumps(bad)) and c.validate(json.dumps(bad)) is not None


def test_unknown_formats_are_annotations(tiny):
    c = compiled.json_schema(tiny, {"type": "string", "format": "colour-of-the-day"})
    assert accepts(c, '"anything"') and c.validate('"anything"') is None


@pytest.mark.parametrize("schema, bad", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    ({"type": "string", "not": {"enum": ["no"]}}, '"no"'),
    ({"type": "array", "contains": {"const": 3}}, "[1]"),
    ({"type": "string", "pattern": "^(?!x)"}, '"xy"'),
    ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, "5"),
])
def test_what_the_grammar_cannot_express_is_validated(tiny, schema, bad):
    c = compiled.json_schema(tiny, schema)
    assert c.validated
    assert accepts(c, bad)                       # the grammar allows a superset...
    assert c.validate(bad) is not None           # ...and validation catches the rest
    with pytest.raises(ValueError, match="not valid"):
        c.parse(bad)


def test_an_invalid_finished_value_is_never_returned(tiny):
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True,
              "minItems": 2, "maxItems": 3}
    gen = ss.json(tiny, schema)
    s = gen("x", max_tokens=30, sampler=HOT, seed=0, num_samples=8)
    flagged = 0
    for text, reason, value in zip(generated(s, "x"), s.finish_reason[0], s.value[0]):
        error = gen.constraint.validate(text)
        if error is None:
            assert reason == "constraint_complete" and value == json.loads(text)
        else:
            assert value is None and reason == "invalid"
            flagged += 1
    assert flagged


def test_one_of_is_generated_as_any_of_and_validated(tiny):
    overlapping = compiled.json_schema(tiny, {"oneOf": [{"type": "integer"}, {"minimum": 0}]})
    assert overlapping.validated == ("oneOf at #",)
    assert accepts(overlapping, "3") and accepts(overlapping, "-3")
    assert overlapping.validate("-3") is None and overlapping.validate("3") is not None
    disjoint = compiled.json_schema(tiny, {"oneOf": [{"type": "integer"}, {"type": "string"}]})
    assert disjoint.validate("3") is None and disjoint.validate('"a"') is None
    assert not accepts(disjoint, "true")


def test_duplicate_keys_are_invalid(tiny):
    c = compiled.json_schema(tiny, {"type": "object", "additionalProperties": {"type": "integer"}})
    assert "duplicate key" in c.validate('{"a": 1, "a": 2}')


@pytest.mark.parametrize("style, good, bad", [
    ("compact", ['{"a":[1,2]}', '{"a": [1, 2]}'], ['{ "a": [1, 2]}', '{"a":\n[1]}']),
    ("pretty", ['{"a": [1, 2]}', json.dumps({"a": [1, 2]}, indent=2)], ['{"a":\t[1]}']),
    ("flexible", ['{ "a" :\t[1 ,2]\n}'], []),
])
def test_whitespace_styles(tiny, style, good, bad):
    c = compiled.json_schema(tiny, {"type": "object", "properties": {"a": {"type": "array"}}},
                             whitespace=style)
    assert all(accepts(c, t) for t in good)
    assert not any(accepts(c, t) for t in bad)


def test_additional_properties_default_and_key_order(tiny):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["b"]}
    closed = compiled.json_schema(tiny, schema)
    opened = compiled.json_schema(tiny, schema, additional_properties=True)
    assert not accepts(closed, '{"b": 1, "c": 2}') and accepts(opened, '{"b": 1, "c": 2}')
    assert accepts(closed, '{"a": 1, "b": 2}') and not accepts(closed, '{"b": 2, "a": 1}')
    first = compiled.json_schema(tiny, schema, key_order="required_first")
    assert accepts(first, '{"b": 2, "a": 1}') and not accepts(first, '{"a": 1, "b": 2}')
    # objects combined by allOf keep the schema's own rule, so the combination stays satisfiable
    both = {"allOf": [{"properties": {"a": {"type": "integer"}}},
                      {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert accepts(compiled.json_schema(tiny, both), '{"a": 1, "b": 2}')
    assert prepare(both).schema == both


def test_unsupported_schemas_name_the_keyword_and_pointer(tiny):
    cases = [
        ({"type": "object", "patternProperties": {"^a": {}, "^ab": {}}},
         r"`patternProperties` at #/patternProperties"),
        ({"properties": {"x": {"$ref": "https://example.com/x.json"}}},
         r"`\$ref` at #/properties/x: remote references \('https://example\.com/x\.json'\)"),
        ({"$ref": "other.json#/a"}, r"`\$ref` at #: remote references"),
        ({"properties": {"x": {"$ref": "#/definitions/missing"}}},
         r"`\$ref` at #/properties/x: '#/definitions/missing' points to nothing"),
        ({"type": "string", "format": "uri", "pattern": "(a"}, "pattern"),
    ]
    for schema, message in cases:
        with pytest.raises(ss.ConstraintError, match=message):
            ss.json(tiny, schema)
    for bad in ("[1, 2]", "{oops", 42):
        with pytest.raises(ss.ConstraintError):
            ss.json(tiny, bad)
    for option, match in [({"whitespace": "tabs"}, "whitespace must be one of"),
                          ({"whitespace": ["compact"]}, "whitespace must be one of"),
                          ({"additional_properties": "yes"}, "True or False"),
                          ({"key_order": "sorted"}, "key_order must be one of")]:
        with pytest.raises(ss.ConstraintError, match=match):
            compiled.json_schema(tiny, OBJECT, **option)


def test_references_inside_the_document_are_not_remote(tiny):
    bundled = {"$id": "https://example.com/root.json",
               "properties": {"a": {"$ref": "https://example.com/root.json#/$defs/n"},
                              "b": {"$ref": "#/$defs/n"}},
               "$defs": {"n": {"type": "integer"}}, "required": ["a", "b"]}
    assert accepts(compiled.json_schema(tiny, bundled), '{"a":1,"b":2}')


def test_large_schemas_are_not_refused_for_their_size(tiny):
    schema = {"type": "object", "description": "x" * 200_000,
              "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    c = compiled.json_schema(tiny, schema)
    assert accepts(c, '{"p0": 1}')


def test_compiled_once_per_schema_and_options(tiny):
    assert compiled.json_schema(tiny, OBJECT) is compiled.json_schema(tiny, dict(OBJECT))
    assert compiled.json_schema(tiny, Person) is compiled.json_schema(tiny, Person)
    assert compiled.json_schema(tiny, OBJECT) is not compiled.json_schema(
        tiny, OBJECT, whitespace="pretty")


def test_prefixed_constraint_for_token_healing(tiny):
    c = compiled.json_schema(tiny, OBJECT).prefixed(": ")
    assert accepts(c, ': {"name": "Bo", "age": 3}')
    assert not accepts(c, '{"name": "Bo", "age": 3}')
    assert c.parse(': {"name": "Bo", "age": 3}') == {"name": "Bo", "age": 3}
    assert c.validate(': {"name": "Bo", "age": -3}') is not None
