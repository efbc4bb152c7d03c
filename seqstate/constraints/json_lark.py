"""JSON schemas with string constants that llguidance cannot quote, compiled through Lark.

llguidance before 1.7.2 (its regex library derivre before 0.3.9) splits a string constant
into chunks of 31 bytes and, when it JSON-quotes a chunk holding a character that JSON
escapes (a quote, a backslash, a control character), drops every chunk after it: a ``const``
or ``enum`` string with such a character followed by 31 more bytes can never be generated,
because the grammar closes the string early.  `needs_lark()` finds such constants; `to_lark()`
then writes the schema as a Lark grammar: the path from the root to each such constant
(objects, arrays, ``anyOf``, ``$ref``) is spelled out as llguidance's JSON compiler spells
it, the constants are Lark literals of their ``json.dumps`` text, and every other subschema
is embedded whole as ``%json {...}`` with the same options.

Examples
--------
>>> text = 'say "hi"' + "." * 40          # a quote at byte 4: more than 31 bytes follow it
>>> truncated(text), truncated(text[:35]), truncated("x" * 99)
(True, False, False)
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from seqstate.constraints.json_pointer import resolve, subschemas
from seqstate.errors import ConstraintError

__all__ = ["needs_lark", "to_lark", "truncated", "LLGUIDANCE_QUOTES_LONG_CONSTANTS"]

_CHUNK = 31                  # derivre's MAX_BYTE_CONCAT: bytes per literal chunk
_ESCAPED = re.compile(rb'[\x00-\x1f"\\\x7f]')
_ANNOTATIONS = frozenset({"title", "description", "$comment", "$schema", "default", "examples",
                          "$id", "id", "definitions", "$defs"})


def _fixed(version: str) -> bool:
    parts = [int(p) for p in re.findall(r"\d+", version)[:3]]
    return parts >= [1, 7, 2]


# llguidance 1.7.2 (derivre 0.3.9) quotes every constant: no workaround is needed there
LLGUIDANCE_QUOTES_LONG_CONSTANTS = _fixed(importlib.metadata.version("llguidance"))


def truncated(text: object) -> bool:
    """Whether llguidance < 1.7.2 truncates the string constant ``text``: a byte JSON escapes
    that is not in its last 31 bytes (derivre chunks literals from the end)."""
    if not isinstance(text, str):
        return False
    data = text.encode()
    return any(m.start() < len(data) - _CHUNK for m in _ESCAPED.finditer(data))


def _constants(node: dict) -> list:
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else []


def needs_lark(schema: object) -> bool:
    """Whether ``schema`` has a string constant that this llguidance cannot generate."""
    if LLGUIDANCE_QUOTES_LONG_CONSTANTS:
        return False
    return any(truncated(v) for _, node in subschemas(schema) for v in _constants(node))


def _literal(value: object) -> str:
    """A Lark literal of ``value``'s JSON text (compact, as llguidance writes constants)."""
    return json.dumps(json.dumps(value, ensure_ascii=False, separators=(",", ":")),
                      ensure_ascii=False)


class _Writer:
    """Lark rules for the parts of a schema that lead to constants llguidance loses."""

    def __init__(self, root: dict, options: dict) -> None:
        self.root, self.options = root, options
        self.defs = {k: root[k] for k in ("definitions", "$defs") if isinstance(root.get(k), dict)}
        self.rules: dict[str, str] = {}
        self.by_pointer: dict[str, str] = {}
        # the $ref targets that lead to a truncated constant, found by fixpoint (refs recurse)
        targets = dict(filter(None, (resolve(root, sub.get("$ref"))
                                     for _, sub in subschemas(root))))
        self.leading: set[str] = set()
        grown = True
        while grown:
            grown = False
            for where, node in targets.items():
                if where not in self.leading and self.leads(node):
                    self.leading.add(where)
                    grown = True

    def leads(self, node: object) -> bool:
        """Whether ``node`` has a truncated constant or refers to a schema that leads to one."""
        for _, sub in subschemas(node):
            if any(truncated(v) for v in _constants(sub)):
                return True
            target = resolve(self.root, sub.get("$ref"))
            if target is not None and target[0] in self.leading:
                return True
        return False

    # -- Lark -------------------------------------------------------------------------------------
    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name

    def value(self, node: object, ptr: str) -> str:
        """A Lark expression for the JSON values ``node`` allows."""
        if node is True or (isinstance(node, dict) and not self.leads(node)):
            return self.embedded({} if node is True else node, ptr)
        if not isinstance(node, dict):
            raise self.unsupported(ptr)
        keys = node.keys() - _ANNOTATIONS
        if keys <= {"const", "enum", "type"} and keys & {"const", "enum"}:
            return "(" + " | ".join(_literal(v) for v in _constants(node)) + ")"
        if keys == {"$ref"}:
            return self.reference(node["$ref"], ptr)
        if len(keys) == 1 and keys <= {"anyOf", "oneOf"}:
            key = next(iter(keys))
            return "(" + " | ".join(self.value(sub, f"{ptr}/{key}/{i}")
                                    for i, sub in enumerate(node[key])) + ")"
        if node.get("type", "object") == "object" and keys <= {"type", "properties", "required",
                                                               "additionalProperties"} \
                and node.get("additionalProperties") is False:
            return self.object(node, ptr)
        if node.get("type") == "array" and keys == {"type", "items"} and isinstance(
                node["items"], (dict, bool)):
            item = self.rule(self.value(node["items"], f"{ptr}/items"))
            return f'"[" ({item} (ITEM_SEP {item})*)? "]"'
        raise self.unsupported(ptr)

    def reference(self, ref: str, ptr: str) -> str:
        target = resolve(self.root, ref)
        if target is None:
            raise self.unsupported(ptr)
        where, node = target
        if where not in self.by_pointer:
            name = self.by_pointer[where] = f"r{len(self.rules)}"
            self.rules[name] = ""                        # reserved: the target may recurse
            self.rules[name] = self.value(node, where)
        return self.by_pointer[where]

    def object(self, node: dict, ptr: str) -> str:
        """llguidance's ordered sequence of properties: the schema's order, optional ones
        left out or not, separators between the ones present."""
        required = set(node.get("required", []))
        props = node.get("properties", {})
        items = [(self.rule(f"{_literal(name)} KEY_SEP "
                            f"{self.value(sub, f'{ptr}/properties/{name}')}"), name in required)
                 for name, sub in props.items()]
        memo: dict[tuple[int, bool], str] = {}

        def sequence(i: int, prefixed: bool) -> str:
            if i == len(items):
                return ""
            if (i, prefixed) not in memo:
                item, needed = items[i]
                here = f"ITEM_SEP {item}" if prefixed else item
                after = sequence(i + 1, True)
                if needed:
                    body = f"{here} {after}"
                elif prefixed:
                    body = f"({here})? {after}"
                else:                      # the first one present has no separator before it
                    without = sequence(i + 1, False)
                    body = f"{item} {after} | {without}" if without else f"({item} {after})?"
                memo[(i, prefixed)] = self.rule(body)
            return memo[(i, prefixed)]

        return f'"{{" {sequence(0, False)} "}}"'

    def embedded(self, node: dict, ptr: str) -> str:
        """``node`` compiled by llguidance's own JSON compiler, with the schema's definitions
        (its ``$ref``s point into them) and the same options."""
        fragment = {**node, "x-guidance": self.options}
        for _, sub in subschemas(node):
            ref = sub.get("$ref")
            if isinstance(ref, str):
                if not ref.startswith(("#/definitions/", "#/$defs/")):
                    raise self.unsupported(ptr)
                fragment = {**self.defs, **fragment}
                break
        return "%json " + json.dumps(fragment, ensure_ascii=False)

    @staticmethod
    def unsupported(ptr: str) -> ConstraintError:
        return ConstraintError(
            f"the JSON schema at {ptr} leads to a string constant (`const`/`enum`) with a quote, "
            "backslash or control character followed by more than 31 bytes, which llguidance "
            "< 1.7.2 cannot generate, in a way seqstate cannot work around; install llguidance "
            ">= 1.7.2, or shorten the constant")


def to_lark(schema: dict, options: dict) -> str:
    """``schema`` (prepared) as a Lark grammar for llguidance, with the JSON compile
    ``options`` (`json_constraint.WHITESPACE`'s)."""
    writer = _Writer(schema, options)
    start = writer.value(schema, "#")
    if options.get("whitespace_pattern"):
        ignore = options["whitespace_pattern"]
    elif options.get("whitespace_flexible", True):
        ignore = r"[\x20\x0A\x0D\x09]+"
    else:
        ignore = None
    lines = [f"start: {start}"]
    lines += [f"{name}: {body}" for name, body in writer.rules.items()]
    lines.append(f"ITEM_SEP: /{options.get('item_separator', ',')}/")
    lines.append(f"KEY_SEP: /{options.get('key_separator', ':')}/")
    if ignore is not None:
        lines.append(f"%ignore /{ignore}/")
    return "\n".join(lines) + "\n"
