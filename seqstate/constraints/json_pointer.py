"""JSON pointers over a schema: walking its subschemas, following and checking ``$ref``s,
replacing a node by pointer.  `json_prepare` rewrites schemas with these."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import unquote

__all__ = ["MAPS", "LISTS", "SINGLE", "escape", "children", "subschemas", "find_keyword",
           "resolve", "check_refs", "replace"]


MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SINGLE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not",
           "if", "then", "else", "unevaluatedItems", "unevaluatedProperties")


def escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def children(node: dict, ptr: str) -> Iterator[tuple[str, str, object]]:
    """``(keyword, pointer, subschema)`` for each subschema directly inside ``node``."""
    for key, value in node.items():
        here = f"{ptr}/{escape(key)}"
        if key in MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield key, f"{here}/{escape(name)}", sub
        elif key in LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield key, f"{here}/{i}", sub
        elif key in SINGLE and isinstance(value, (dict, bool)):
            yield key, here, value
        elif key == "dependencies" and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    yield key, f"{here}/{escape(name)}", sub


def subschemas(schema: object) -> Iterator[tuple[str, dict]]:
    """``(pointer, node)`` for every schema object reachable through schema keywords."""
    stack = [("#", schema)]
    while stack:
        ptr, node = stack.pop()
        if isinstance(node, dict):
            yield ptr, node
            stack.extend((p, sub) for _, p, sub in reversed(list(children(node, ptr))))


def find_keyword(schema: object, keyword: str) -> str | None:
    """The JSON pointer of the first schema node that uses ``keyword``, or None."""
    return next((f"{ptr}/{escape(keyword)}" for ptr, node in subschemas(schema)
                 if keyword in node), None)


def resolve(root: object, ref: object) -> tuple[str, object] | None:
    """``(pointer, node)`` of a ``$ref`` inside this document, or None for any other reference."""
    if not isinstance(ref, str):
        return None
    base = root.get("$id", root.get("id")) if isinstance(root, dict) else None
    where, _, fragment = ref.partition("#")
    if where and where != base:
        return None
    if fragment and not fragment.startswith("/"):
        return None                                     # an anchor name: not followed here
    node, pointer = root, "#"
    for part in fragment.split("/")[1:]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
        pointer += "/" + escape(part)
    return pointer, node


def check_refs(root: object) -> str | None:
    """Why a ``$ref`` of ``root`` cannot be followed (naming it and its JSON pointer), or None.

    References into this document (JSON pointers, anchors, ``$id``s it declares) are fine;
    a remote one, or a pointer to nothing, is reported before llguidance sees the schema.
    """
    ids = {node[key] for _, node in subschemas(root) for key in ("$id", "id")
           if isinstance(node.get(key), str)}
    for ptr, node in subschemas(root):
        ref = node.get("$ref")
        if not isinstance(ref, str):
            continue
        where, _, fragment = ref.partition("#")
        if where and not any(i == where or i.rstrip("#").endswith("/" + where) for i in ids):
            return (f"`$ref` at {ptr}: remote references ({ref!r}) are not supported, seqstate "
                    "never downloads; copy the referenced schema into this one's `$defs` and "
                    "refer to it as '#/$defs/<name>'")
        if not where and fragment.startswith("/") and resolve(root, ref) is None:
            return (f"`$ref` at {ptr}: {ref!r} points to nothing in this schema; fix the "
                    "pointer or add the schema it names")
    return None


def replace(root: object, pointer: str, value: object) -> object:
    """``root`` with the node at ``pointer`` replaced, copying only the containers on the way."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    if not parts:
        return value
    head = parts[0]
    index = int(head) if isinstance(root, list) and head.isdigit() else head
    try:
        child = root[index]
    except (KeyError, IndexError, TypeError):
        return root                 # inside a dropped keyword: llguidance reports the $ref
    copy = list(root) if isinstance(root, list) else dict(root)
    copy[index] = replace(child, "#" + pointer[len("#/" + escape(head)):], value)
    return copy

