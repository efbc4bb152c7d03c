"""JSON schemas prepared for llguidance: what the grammar enforces and what is validated after.

llguidance compiles most of JSON Schema exactly.  `prepare()` rewrites a copy of the schema
before it sees it:

- string ``format``s are enforced as patterns (`json_formats`); formats nobody knows are
  annotations, as the specification says, and are dropped;
- keywords that a grammar cannot express (:data:`VALIDATED`) are dropped, so the grammar allows a
  superset; every finished value is validated against the *original* schema, so the superset
  never reaches the user as a valid value;
- the options: ``additionalProperties`` default and key order.

The rewrite keeps every node at its JSON pointer, so ``$ref``s still resolve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from seqstate.constraints.json_formats import format_regex
from seqstate.constraints.json_pointer import (LISTS, MAPS, SINGLE, children, escape, replace,
                                              resolve)

__all__ = ["VALIDATED", "KEY_ORDERS", "Prepared", "prepare"]

VALIDATED = ("uniqueItems", "dependencies", "dependentRequired", "dependentSchemas", "not",
             "if", "then", "else", "contains", "minContains", "maxContains", "propertyNames",
             "unevaluatedProperties", "unevaluatedItems")
KEY_ORDERS = ("schema", "required_first")

# keywords that decide which keys an object may have, with the applicators that combine schemas
_OBJECT_KEYS = frozenset({
    "properties", "required", "additionalProperties", "patternProperties", "minProperties",
    "maxProperties", "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
    "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not"})
_APPLICATORS = frozenset({"allOf", "anyOf", "oneOf", "$ref"})
# keywords that may require keys the node itself does not declare
_REQUIRING = _APPLICATORS | {"if", "then", "else", "not", "dependencies", "dependentSchemas"}
_LOOKAROUND = re.compile(r"\(\?<?[=!]|\\[1-9]")     # lookarounds and backreferences
_ANNOTATIONS = frozenset({"title", "description", "$comment", "$schema", "default", "examples"})


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A schema rewritten for llguidance, with what only validation checks, by JSON pointer."""

    schema: object
    validated: tuple[str, ...]          # "keyword at pointer" the grammar leaves to validation
    origins: dict[str, str]             # pointer of each typed copy -> pointer of its original


def _types(value: object) -> set[str]:
    types = set(value) if isinstance(value, list) else {value}
    return types | {"integer"} if "number" in types else types


def _combined(root: object) -> set[str] | None:
    """Pointers of schemas that are intersected with others (``allOf``, sibling applicators).

    Closing such an object to undeclared keys could forbid keys that the schema it is combined
    with requires, so the ``additionalProperties`` default leaves them alone.  None when a
    ``$ref`` cannot be followed, so nothing is known to be safe.
    """
    combined: set[str] = set()
    seen: set[tuple[str, bool]] = set()
    stack: list[tuple[str, object, bool]] = [("#", root, False)]
    while stack:
        ptr, node, inside = stack.pop()
        if not isinstance(node, dict) or (ptr, inside) in seen:
            continue
        seen.add((ptr, inside))
        if inside or _REQUIRING & node.keys():
            combined.add(ptr)
        if "$ref" in node:
            target = resolve(root, node["$ref"])
            if target is None:
                return None
            stack.append((*target, inside or bool((node.keys() - {"$ref"}) & _OBJECT_KEYS)))
        for key, here, sub in children(node, ptr):
            if key == "allOf":
                stack.append((here, sub, True))
            elif key in ("anyOf", "oneOf"):
                stack.append((here, sub, inside or bool((node.keys() - {key}) & _OBJECT_KEYS)))
            elif key not in VALIDATED and key not in ("definitions", "$defs"):
                stack.append((here, sub, False))         # a value of its own: a fresh start
    return combined


def _distribute_type(node: dict) -> dict:
    """``{"anyOf": [A, B], "type": T}`` as ``{"anyOf": [A and T, B and T]}`` (also ``oneOf``).

    The two are equivalent, and llguidance cannot intersect a sibling ``type`` with branches
    that are recursive references; `_Rewriter._follow()` then folds ``T`` into each target.
    """
    for key in ("anyOf", "oneOf"):
        if (not isinstance(node.get(key), list) or "type" not in node
                or node.keys() - _ANNOTATIONS - {key, "type"}):
            continue
        branches = []
        for branch in node[key]:
            branch = {} if branch is True else branch
            if isinstance(branch, dict) and "type" not in branch:
                branch = {**branch, "type": node["type"]}
            elif isinstance(branch, dict) and not _types(branch["type"]) <= _types(node["type"]):
                return node
            branches.append(branch)
        return {**{k: v for k, v in node.items() if k != "type"}, key: branches}
    return node


class _Rewriter:
    def __init__(self, root: object, closed: bool, key_order: str,
                 combined: set[str] | None) -> None:
        self.root = root
        self.closed = closed and combined is not None
        self.key_order = key_order
        self.combined = combined or set()
        self.validated: list[str] = []
        self.seen: set[str] = set()
        self.pending: list[str] = []          # $ref targets outside the schema keywords walked
        self.typed: dict[tuple[str, str], str] = {}
        self.extra: dict[str, object] = {}    # typed copies, added to the definitions

    def run(self) -> object:
        out = self.node(self.root, "#")
        while self.pending:
            ptr = self.pending.pop()
            if ptr not in self.seen:
                out = replace(out, ptr, self.node(resolve(self.root, ptr)[1], ptr))
        if self.extra and isinstance(out, dict):
            out = {**out, "definitions": {**out.get("definitions", {}), **self.extra}}
        return out

    def node(self, node: object, ptr: str) -> object:
        self.seen.add(ptr)
        if not isinstance(node, dict):
            return node
        if node.get("not") in ({}, True):
            return False                                  # `not: {}` matches nothing
        node = _distribute_type(node)
        out: dict = {}
        for key, value in node.items():
            here = f"{ptr}/{escape(key)}"
            if key in VALIDATED:
                if not (key == "uniqueItems" and value is False):      # false is the default
                    self.validated.append(f"{key} at {ptr}")
            elif key in MAPS and isinstance(value, dict):
                out[key] = {k: self.node(v, f"{here}/{escape(k)}") for k, v in value.items()}
            elif key in LISTS and isinstance(value, list):
                out[key] = [self.node(v, f"{here}/{i}") for i, v in enumerate(value)]
            elif key in SINGLE:
                out[key] = self.node(value, here)
            else:
                out[key] = value
        if "oneOf" in out:
            self.validated.append(f"oneOf at {ptr}")
        if "$ref" in out:
            self._follow(out)
        if isinstance(out.get("pattern"), str) and _LOOKAROUND.search(out["pattern"]):
            del out["pattern"]                            # llguidance's regexes have none
            self.validated.append(f"pattern at {ptr}")
        self._format(out, ptr)
        self._bounds(out)
        if self.closed and ptr not in self.combined:
            self._close(out)
        if self.key_order == "required_first" and isinstance(out.get("properties"), dict):
            required = out.get("required") if isinstance(out.get("required"), list) else []
            props = out["properties"]
            order = sorted(props, key=lambda k: k not in required)     # stable: schema order
            out["properties"] = {k: props[k] for k in order}
        return out

    def _format(self, out: dict, ptr: str) -> None:
        name = out.get("format")
        if not isinstance(name, str):
            return
        del out["format"]
        enforced = format_regex(name)
        if enforced is None:
            self.validated.append(f"format {name!r} at {ptr}")
            return
        regex, max_length = enforced
        rule: dict = {"pattern": f"^(?:{regex})$"}
        if max_length is not None:
            rule["maxLength"] = max_length
        if "pattern" in out or "maxLength" in out:
            out["allOf"] = [*out.get("allOf", []), rule]
        else:
            out.update(rule)

    def _follow(self, out: dict) -> None:
        """Queue the target of ``out``'s ``$ref``, and fold a sibling ``type`` into the target.

        llguidance cannot intersect a recursive ``$ref`` with sibling keywords, and
        ``{"type": "object", "$ref": ...}`` is common: the ``type`` is dropped when the target
        implies it, or moved into a typed copy of a target that has no ``type``.
        """
        target = resolve(self.root, out["$ref"])
        if target is None:
            return
        self.pending.append(target[0])
        for _ in range(8):                                # a chain of plain references
            if isinstance(target[1], dict) and set(target[1]) == {"$ref"}:
                target = resolve(self.root, target[1]["$ref"]) or target
        ptr, node = target
        if "type" not in out or not isinstance(node, dict):
            return
        if "type" in node:
            if _types(node["type"]) <= _types(out["type"]):
                del out["type"]
        elif "$ref" not in node and not (out.keys() - _ANNOTATIONS - {"$ref", "type"}):
            out["$ref"] = self._typed(ptr, node, out.pop("type"))

    def _typed(self, ptr: str, node: dict, types: object) -> str:
        """A pointer to a copy of ``node`` (at ``ptr``) restricted to ``types``."""
        key = (ptr, json.dumps(types))
        if key not in self.typed:
            name = f"seqstate-typed-{len(self.typed)}"
            where = f"#/definitions/{name}"
            self.typed[key] = where
            if ptr in self.combined:
                self.combined.add(where)
            self.extra[name] = self.node({**node, "type": types}, where)
        return self.typed[key]

    @staticmethod
    def _bounds(out: dict) -> None:
        """Drop infinite bounds that allow every number (huge literals parse as infinities)."""
        for key, unbounded in (("minimum", -math.inf), ("exclusiveMinimum", -math.inf),
                               ("maximum", math.inf), ("exclusiveMaximum", math.inf)):
            if out.get(key) == unbounded:
                del out[key]

    @staticmethod
    def _close(out: dict) -> None:
        """Allow only declared properties (and required ones, with any value)."""
        props = out.get("properties")
        if not isinstance(props, dict) or out.keys() & {
                "additionalProperties", "patternProperties", "unevaluatedProperties"}:
            return
        required = out.get("required") if isinstance(out.get("required"), list) else []
        props = {**props, **{k: {} for k in required if isinstance(k, str) and k not in props}}
        least = out.get("minProperties", 0)
        if not isinstance(least, int) or least > len(props):
            return
        out["properties"] = props
        out["additionalProperties"] = False


def prepare(schema: object, *, additional_properties: bool = False,
            key_order: str = "schema") -> Prepared:
    """Rewrite ``schema`` for llguidance (see the module docstring); ``schema`` is not modified.

    Examples
    --------
    >>> p = prepare({"type": "object", "properties": {"id": {"format": "uuid"}},
    ...              "uniqueItems": True})
    >>> p.schema["additionalProperties"], "format" in p.schema["properties"]["id"]
    (False, False)
    >>> p.validated
    ('uniqueItems at #',)
    """
    combined = _combined(schema) if not additional_properties else set()
    rewriter = _Rewriter(schema, not additional_properties, key_order, combined)
    out = rewriter.run()
    # a node can be walked twice (as a definition and as a $ref target); typed copies are ours
    notes = [v for v in dict.fromkeys(rewriter.validated) if "/seqstate-typed-" not in v]
    origins = {copy: ptr for (ptr, _), copy in rewriter.typed.items()}
    return Prepared(out, tuple(notes), origins)
