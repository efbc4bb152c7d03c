"""MaskBench's instance forms (benchmarks/maskbench.py): the texts each test instance is tried
as, in its own key order and in the schema's, compact and spaced."""

from benchmarks.maskbench import forms, schema_order

SCHEMA = {
    "$defs": {"point": {"properties": {"y": {}, "x": {}}}},
    "properties": {"b": {"$ref": "#/$defs/point"}, "a": {"type": "array",
                                                         "items": {"$ref": "#/$defs/point"}}},
    "allOf": [{"properties": {"c": {"properties": {"q": {}, "p": {}}}}}],
    "patternProperties": {"^z": {"properties": {"k": {}, "j": {}}}},
}


def test_keys_follow_properties_through_refs_combinators_items_and_patterns():
    value = {"extra": 0, "z1": {"j": 1, "k": 2}, "c": {"p": 3, "q": 4}, "a": [{"x": 5, "y": 6}],
             "b": {"x": 7, "y": 8}}
    ordered = schema_order(value, SCHEMA)
    assert ordered == value
    assert list(ordered) == ["b", "a", "c", "extra", "z1"]
    assert list(ordered["b"]) == ["y", "x"] and list(ordered["a"][0]) == ["y", "x"]
    assert list(ordered["c"]) == ["q", "p"] and list(ordered["z1"]) == ["k", "j"]


def test_forms_are_both_orders_with_both_separators_each_once():
    assert forms({"b": 1, "a": ["é"]}, {"properties": {"a": {}, "b": {}}}) == [
        '{"b":1,"a":["é"]}', '{"b": 1, "a": ["é"]}', '{"a":["é"],"b":1}', '{"a": ["é"], "b": 1}']
    assert forms([1, 2], {"items": {}}) == ["[1,2]", "[1, 2]"]


def test_a_recursive_schema_ends():
    schema = {"properties": {"next": {"$ref": "#"}, "v": {}}}
    assert list(schema_order({"v": 1, "next": {"v": 2, "next": None}}, schema)["next"]) == \
        ["next", "v"]
