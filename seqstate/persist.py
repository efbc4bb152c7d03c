"""The saved-state format: a state's rows as versioned JSON bytes, readable without running code.

``state.dumps()`` writes it; ``ss.loads(model, data)`` (`seqstate.restore`) reads it back.
The document carries a digest of its fields: bytes changed after saving are refused
(`seqstate.StateFormatError`), and states saved before the digest still load.  What is saved
is what a state *is*: each row's token ids, log-probs, generator calls' spans
(their finish reasons, values, option scores, capture names) and conversation record.  What a
state merely *has* is not saved: KV (a cache, recomputed once from the tokens when first
needed) and constraint cursors (recreated by replaying a call's tokens when it is resumed).

Values are JSON; a pydantic model is saved as its JSON with its class's name, an enum member
as its value with its class's name, a tuple or a dict with other than plain string keys in a
tagged form.  Reading never imports or runs anything named in the data: a class is used only
when the caller gives it (``types=``).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from seqstate.errors import StateFormatError
from seqstate.finish import FinishReason
from seqstate.rows import Chat, Row, SavedCall, Span

__all__ = ["FORMAT", "VERSION", "encode_rows", "decode_rows", "to_json", "from_json",
           "class_name", "tokenizer_id", "SavedState"]

FORMAT = "seqstate-state"
VERSION = 1


def class_name(cls: type) -> str:
    """``module:qualname``: how a class is named in saved data."""
    return f"{cls.__module__}:{cls.__qualname__}"


class Classes:
    """The classes a caller gave (``types=``), found by the name saved data holds.

    The rule: a saved ``module:qualname`` names the given class of that module and qualified
    name; where the saved module or the given class's module is ``__main__`` (a class defined
    in the script that was run), the qualified name alone, if one given class has it.  So a
    class saved by a script and loaded by a module that imports it from that script matches.
    ``missing`` collects the saved names no given class matched; ``used`` the classes found.
    """

    def __init__(self, types: Iterable[type] = ()) -> None:
        self.given = {class_name(t): t for t in types}
        self.missing: set[str] = set()
        self.used: set[type] = set()

    def find(self, name: str) -> type | None:
        """The given class the saved ``name`` names, by the rule; None if none."""
        if name in self.given:
            return self.given[name]
        module, _, qualname = name.partition(":")
        same = [t for t in self.given.values()
                if t.__qualname__ == qualname and "__main__" in (module, t.__module__)]
        return same[0] if len(same) == 1 else None

    def get(self, name: str) -> type | None:
        """`find`, recording the name as ``missing`` or its class as ``used``."""
        cls = self.find(name)
        if cls is None:
            self.missing.add(name)
        else:
            self.used.add(cls)
        return cls

    def unmatched(self) -> str | None:
        """Where classes were given, none of them used, and saved names left unmatched: what
        to say (the values stayed JSON); else None."""
        unused = set(self.given.values()) - self.used
        if not self.missing or not unused:
            return None
        return (f"the saved values name {', '.join(sorted(self.missing))}, which the given "
                f"{', '.join(sorted(class_name(t) for t in unused))} did not match (a class "
                "matches by module and qualified name, or by qualified name alone where one "
                "side is __main__); pass the classes the values were saved from")


def tokenizer_id(vocab: Any) -> str:
    """A digest of a vocabulary's tokens (their exact bytes, in id order) and special ids:
    states saved under one tokenizer load only under the same."""
    return vocab.table("persist.tokenizer_id", lambda: _digest(vocab))


def _digest(vocab: Any) -> str:
    h = hashlib.sha256()
    for piece in vocab.token_bytes:
        h.update(len(piece).to_bytes(4, "little"))
        h.update(piece)
    h.update(json.dumps(sorted(vocab.special_ids)).encode())
    return h.hexdigest()[:32]


# -- values -------------------------------------------------------------------------------------
def to_json(value: Any, other: Callable[[Any], Any] | None = None) -> Any:
    """``value`` as JSON data (see the module docstring); ``other(value)`` encodes what is not
    covered (it raises where it cannot), else `StateFormatError`."""
    if value is None or isinstance(value, (bool, int, str)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, enum.Enum):
        return {"$enum": class_name(type(value)), "value": to_json(value.value, other)}
    if isinstance(value, list):
        return [to_json(v, other) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [to_json(v, other) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: to_json(v, other) for k, v in value.items()}
        return {"$dict": [[to_json(k, other), to_json(v, other)] for k, v in value.items()]}
    dump = getattr(type(value), "model_dump", None)
    if dump is not None and hasattr(type(value), "model_validate"):       # a pydantic model
        return {"$pydantic": class_name(type(value)), "json": value.model_dump(mode="json")}
    if other is not None:
        return other(value)
    raise StateFormatError(f"cannot save a value of type {type(value).__name__} ({value!r:.60}):"
                           " saved states hold JSON values, pydantic models, enums, tuples and "
                           "dicts of those; convert it to one of these first")


def from_json(data: Any, types: dict[str, type], other: Callable[[dict], Any] | None = None
              ) -> Any:
    """The value `to_json` saved.  A pydantic model or enum whose class is in ``types``
    (by `class_name`) is rebuilt (a model re-validated); otherwise its JSON or value is
    returned as it is.  ``other(data)`` decodes tags `to_json`'s ``other`` wrote."""
    if isinstance(data, list):
        return [from_json(v, types, other) for v in data]
    if not isinstance(data, dict):
        return data
    if "$float" in data:
        return float(data["$float"])
    if "$tuple" in data:
        return tuple(from_json(v, types, other) for v in data["$tuple"])
    if "$dict" in data:
        return {_hashable(from_json(k, types, other)): from_json(v, types, other)
                for k, v in data["$dict"]}
    if "$enum" in data:
        value = from_json(data["value"], types, other)
        cls = types.get(data["$enum"])
        return value if cls is None else cls(value)
    if "$pydantic" in data:
        cls = types.get(data["$pydantic"])
        return data["json"] if cls is None else cls.model_validate(data["json"])
    if any(k.startswith("$") for k in data):
        if other is None:
            raise StateFormatError(f"unknown tagged value {sorted(data)[:3]} in saved data; "
                                   "was it written by a newer seqstate?")
        return other(data)
    return {k: from_json(v, types, other) for k, v in data.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


# -- rows ---------------------------------------------------------------------------------------
def _array(values: np.ndarray) -> str:
    return base64.b64encode(values.tobytes()).decode("ascii")


def _span(span: Span) -> dict:
    made = span.generator
    if isinstance(made, SavedCall):
        call, constrained = made.name, made.constrained
    else:
        call = getattr(made, "name", "text")
        constrained = getattr(made, "constraint", None) is not None
    return {"start": span.start, "end": span.end, "call": call, "constrained": constrained,
            "finish": None if span.finish_reason is None else str(span.finish_reason),
            "value": to_json(span.value), "scores": span.scores, "name": span.name,
            "text": span.text}


def _row(row: Row) -> dict:
    logprobs = np.array([math.nan if lp is None else lp for lp in row.logprobs], dtype="<f8")
    chat = row.chat
    return {"tokens": _array(np.array(row.tokens, dtype="<i4")), "logprobs": _array(logprobs),
            "spans": [_span(s) for s in row.spans],
            "chat": None if chat is None else {
                "messages": [list(m) for m in chat.messages], "ends": list(chat.ends),
                "open_at": chat.open_at, "answered": chat.answered}}


def encode_rows(model: Any, rows: Sequence[Row], shape: tuple[int, int]) -> bytes:
    """The saved form of a state's rows (batch-major) of ``shape`` on ``model``."""
    doc = {"format": FORMAT, "version": VERSION, "model": getattr(model, "name", None),
           "tokenizer": tokenizer_id(model.vocab), "shape": list(shape),
           "rows": [_row(r) for r in rows]}
    doc["digest"] = _doc_digest(doc)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


_FIELDS = {"format", "version", "model", "tokenizer", "shape", "rows"}


def _doc_digest(doc: dict) -> str:
    """A digest of every field of a saved document but ``digest`` itself, as parsed (the
    same whatever the JSON's spacing)."""
    fields = {k: v for k, v in doc.items() if k != "digest"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read(data: bytes) -> dict:
    """The saved document in ``data``, its format and version checked."""
    if isinstance(data, SavedState):
        data = data.data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise StateFormatError(f"ss.loads reads the bytes state.dumps() wrote, got "
                               f"{type(data).__name__}")
    try:
        doc = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFormatError(f"these bytes are not a saved state ({exc}); give ss.loads what "
                               "state.dumps() returned") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateFormatError("these bytes are not a saved state (no seqstate-state header); "
                               "give ss.loads what state.dumps() returned")
    if doc.get("version") != VERSION:
        raise StateFormatError(f"saved-state format version {doc.get('version')!r}; this "
                               f"seqstate reads version {VERSION}: load it with the seqstate "
                               "that saved it, or a newer one")
    # states saved before the digest have none, and no other field
    if set(doc) - _FIELDS != ({"digest"} if "digest" in doc else set()) or (
            "digest" in doc and doc["digest"] != _doc_digest(doc)):
        raise StateFormatError("a damaged saved state: its digest does not match its content "
                               "(the bytes were changed after state.dumps() wrote them); load "
                               "an intact copy")
    return doc


def decode_rows(doc: dict, chat: type[Chat], types: dict[str, type]
                ) -> tuple[list[Row], int, int]:
    """The rows of a `read` document (no KV, no cursors) and its ``(batch, samples)``;
    conversation records are built as ``chat``, values' classes found in ``types`` (by
    `class_name`; any object with ``get``), as `from_json` finds them."""
    rows = []
    try:
        for r in doc["rows"]:
            tokens = tuple(int(t) for t in np.frombuffer(base64.b64decode(r["tokens"]), "<i4"))
            lps = np.frombuffer(base64.b64decode(r["logprobs"]), "<f8")
            logprobs = tuple(None if math.isnan(x) else float(x) for x in lps)
            if len(logprobs) != len(tokens):
                raise ValueError("tokens and log-probs differ in length")
            spans = tuple(Span(s["start"], s["end"], SavedCall(s["call"], s["constrained"]),
                               None if s["finish"] is None else FinishReason(s["finish"]),
                               from_json(s["value"], types), s["scores"], s["name"],
                               s["text"])
                          for s in r["spans"])
            record = r["chat"]
            convo = None if record is None else chat(
                tuple(tuple(m) for m in record["messages"]), tuple(record["ends"]),
                record["open_at"], record["answered"])
            rows.append(Row(tokens, None, logprobs, (None,) * len(tokens), spans, convo))
        batch, samples = doc["shape"]
    except (KeyError, TypeError, ValueError) as exc:
        raise StateFormatError(f"a damaged saved state: {exc!r}") from None
    return rows, batch, samples


@dataclasses.dataclass(frozen=True, slots=True)
class SavedState:
    """What ``pickle.loads`` gives for a pickled state: its saved bytes, not yet bound to a
    model (a model cannot travel in a pickle).  ``ss.loads(model, saved)`` makes it a state
    again, as it does the bytes.

    Attributes
    ----------
    data : bytes
        ``state.dumps()`` of the pickled state.
    """

    data: bytes

    @property
    def shape(self) -> tuple[int, int]:
        """The saved state's ``(batch, samples)``."""
        return tuple(read(self.data)["shape"])
