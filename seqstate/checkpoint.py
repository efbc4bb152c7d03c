"""Durable runs: ``ss.run_batch(program, inputs, checkpoint="run.sqlite")``.

Each input's result is written to an SQLite database (the standard library's, in WAL mode with
full synchronisation) in its own transaction as soon as its program returns, so a run killed
at any moment keeps every result it finished.  Run again with the same checkpoint, finished
inputs get their stored results without their program being called.

A checkpoint belongs to one run: its program (qualified name, bytecode, and the data a partial
binds or its defaults hold), the models the program uses (name, engine, tokenizer) and its
input list.  Any other is refused with `seqstate.CheckpointError` before anything runs.
Inputs are identified by their data: JSON values, states (by their saved form), pydantic
models, enums, dataclasses, bytes, and tuples, lists and dicts of those; an input of another
type is refused before anything runs (pass an id or a path the program looks up instead).

A result is stored as JSON data (states as ``state.dumps()`` does, pydantic models and enums
by class name, rebuilt into their classes when resumed), with a digest: a row whose digest
does not match (a torn write) is run again, never read.  A failed input is not stored:
a rerun tries it again.  A result that cannot be stored stops the run at the first one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import sqlite3
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import CodeType
from typing import Any

from seqstate.conversation import Conversation
from seqstate.errors import CheckpointError, StateFormatError
from seqstate.persist import class_name, decode_rows, from_json, read, to_json, tokenizer_id
from seqstate.state import SequenceState

__all__ = ["Checkpoint", "program_id", "models_of"]

VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    idx INTEGER PRIMARY KEY, input TEXT NOT NULL, data BLOB NOT NULL, digest TEXT NOT NULL);
"""


class Checkpoint:
    """The SQLite store of one ``run_batch`` run's results (see the module docstring).

    Parameters
    ----------
    path : str or os.PathLike
        The database file; created when missing.
    program : callable
        The run's program.
    inputs : sequence
        The run's inputs, in order.
    """

    def __init__(self, path: Any, program: Callable, inputs: Sequence[Any]) -> None:
        self.path = path
        self.models = models_of(program)
        self.inputs = [_digest(_input_text(i, x)) for i, x in enumerate(inputs)]
        identity = {"version": str(VERSION), "program": program_id(program),
                    "models": json.dumps(sorted(self.models)),
                    "inputs": _digest(self.inputs), "count": str(len(self.inputs))}
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            raise CheckpointError(f"cannot open checkpoint {str(path)!r} ({exc}); give the "
                                  "path of a checkpoint run_batch wrote, or a new file") from None
        try:
            with self._sqlite_errors("open"):
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
                self._claim(identity)
        except BaseException:
            self._db.close()
            raise

    def _claim(self, identity: dict[str, str]) -> None:
        """Write the run's identity into a new checkpoint; refuse one of another run."""
        # read and write in one write transaction: two processes starting on one new file
        # cannot both find it empty
        with self._lock, self._transaction():
            stored = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
            if not stored:
                self._db.executemany("INSERT INTO meta VALUES (?, ?)", identity.items())
                return
        what = {"version": "format version", "program": "program", "models": "models",
                "inputs": "input list", "count": "number of inputs"}
        for key, name in what.items():
            if stored.get(key) != identity[key]:
                raise CheckpointError(
                    f"checkpoint {str(self.path)!r} belongs to another run: its {name} differs "
                    f"(stored {_short(stored.get(key))}, this run {_short(identity[key])}); "
                    "pass another checkpoint path, or delete this file to start over")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """The block as one committed transaction (rolled back where it raises)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self._db.in_transaction:     # SQLite rolls back some failures itself
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @contextlib.contextmanager
    def _sqlite_errors(self, doing: str) -> Iterator[None]:
        """SQLite's errors (a locked or full disk, a damaged file) as `CheckpointError`."""
        try:
            yield
        except sqlite3.Error as exc:
            raise CheckpointError(f"cannot {doing} checkpoint {str(self.path)!r}: {exc}; give "
                                  "the path of a checkpoint run_batch wrote, or a new file, on "
                                  "a disk with room, that no other run is writing") from None

    # -- results -----------------------------------------------------------------------------
    def finished(self) -> dict[int, Any]:
        """The stored results by input index; rows that fail their digest are left out (their
        inputs run again)."""
        with self._lock, self._sqlite_errors("read"):
            rows = self._db.execute("SELECT idx, input, data, digest FROM results").fetchall()
        classes = _Imported()
        state = functools.partial(self._decode_state, classes=classes)
        out = {}
        for idx, key, data, digest in rows:
            if (0 <= idx < len(self.inputs) and key == self.inputs[idx]
                    and hashlib.sha256(data).hexdigest() == digest):
                try:
                    out[idx] = from_json(json.loads(data), classes, state)
                except (ValueError, StateFormatError):
                    continue                    # unreadable: run it again
        if classes.missing:
            raise CheckpointError(
                f"the stored results hold values of {', '.join(sorted(classes.missing))}, "
                "classes no imported module has; import their modules before run_batch, so "
                "that resumed results are rebuilt as the first run returned them")
        return out

    def put(self, idx: int, result: Any) -> None:
        """Store input ``idx``'s result durably (one transaction); `CheckpointError` where it
        cannot be stored."""
        try:
            _importable(result)
            data = json.dumps(to_json(result, self._encode_state), separators=(",", ":"),
                              allow_nan=False).encode()
        except StateFormatError as exc:
            raise CheckpointError(f"the result of input {idx} cannot be stored in the "
                                  f"checkpoint: {exc}") from None
        with self._lock, self._sqlite_errors("write to"), self._transaction():
            self._db.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?)",
                             (idx, self.inputs[idx], data, hashlib.sha256(data).hexdigest()))

    def close(self) -> None:
        """Close the database (what was stored stays)."""
        with self._lock:
            self._db.close()

    # -- states ------------------------------------------------------------------------------
    def _encode_state(self, value: Any) -> Any:
        if not isinstance(value, SequenceState):
            raise StateFormatError(f"cannot store a value of type {type(value).__name__} "
                                   f"({value!r:.60}): results are JSON values, states, pydantic "
                                   "models, enums, tuples and dicts of those")
        if _model_key(value.model) not in self.models:
            raise StateFormatError(f"the result holds a state of {value.model.name!r}, a model "
                                   "the program does not name (run_batch finds models among "
                                   "the names the program uses); use the model through a name "
                                   "the program reads")
        for row in value.rows:
            for span in row.spans:
                _importable(span.value)
        return {"$state": json.loads(value.dumps())}

    def _decode_state(self, data: dict, classes: _Imported) -> Any:
        if "$state" not in data:
            raise StateFormatError(f"unknown tagged value {sorted(data)[:3]} in a checkpoint")
        doc = read(json.dumps(data["$state"]).encode())
        for model in self.models.values():
            if tokenizer_id(model.vocab) == doc["tokenizer"] and model.name == doc["model"]:
                rows, batch, samples = decode_rows(doc, Conversation, classes)
                return SequenceState(model, tuple(rows), batch, samples)
        raise StateFormatError("a stored state's model is not the program's")


class _Imported:
    """Classes by `class_name`, found among modules already imported (never importing one):
    a stored pydantic result is re-validated into its class.  ``missing`` collects the names
    not found."""

    def __init__(self) -> None:
        self.missing: set[str] = set()

    def get(self, name: str) -> type | None:
        module, _, qualname = name.partition(":")
        found: Any = sys.modules.get(module)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if isinstance(found, type):
            return found
        self.missing.add(name)
        return None


def _importable(value: Any) -> None:
    """Raise `StateFormatError` for a pydantic or enum value whose class a rerun cannot find."""
    cls = type(value)
    if (hasattr(cls, "model_validate") or hasattr(cls, "_member_map_")) and \
            _Imported().get(class_name(cls)) is not cls:
        raise StateFormatError(f"{class_name(cls)} is not reachable by its name (a class "
                               "defined inside a function?), so a rerun could not rebuild it; "
                               "define it at module level")
    if isinstance(value, (list, tuple)):
        for v in value:
            _importable(v)
    elif isinstance(value, dict):
        for item in value.items():
            _importable(item)


# -- identities ---------------------------------------------------------------------------------
def program_id(program: Callable) -> str:
    """The program's qualified name and a digest of its bytecode (and its constants'), of
    the arguments partials bind and of its defaults."""
    func, bound = program, []
    while isinstance(func, functools.partial):
        bound.append([func.args, func.keywords])
        func = func.func
    defaults = [getattr(func, "__defaults__", None), getattr(func, "__kwdefaults__", None)]
    if any(defaults):
        bound.append(defaults)
    name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}"
    code = getattr(func, "__code__", None)
    text = ("" if code is None else _code_text(code)) + (_bound_text(bound) if bound else "")
    return f"{name}:{_digest(text)}" if text else name


def _code_text(code: CodeType) -> str:
    consts = [_const_text(c) for c in code.co_consts]
    return code.co_code.hex() + "|" + "|".join(consts) + "|" + ",".join(code.co_names)


def _const_text(const: Any) -> str:
    """A constant's text, the same in every process: a set literal's frozenset is written
    sorted (its own order follows the process's string hashing)."""
    if isinstance(const, CodeType):
        return _code_text(const)
    if isinstance(const, frozenset):
        return "frozenset(" + ",".join(sorted(_const_text(c) for c in const)) + ")"
    if isinstance(const, tuple):
        return "(" + ",".join(_const_text(c) for c in const) + ")"
    return repr(const)


def models_of(program: Callable) -> dict[str, Any]:
    """The models a program uses, by key (name, engine, tokenizer): those it reads through
    names (globals, closure cells, defaults, a partial's arguments), directly or as a
    generator's model."""
    seen: list[Any] = []
    func = program
    while isinstance(func, functools.partial):
        seen += list(func.args) + list(func.keywords.values())
        func = func.func
    code = getattr(func, "__code__", None)
    if code is not None:
        names = set(code.co_names) | _nested_names(code)
        globs = getattr(func, "__globals__", {})
        seen += [globs[n] for n in names if n in globs]
        seen += [c.cell_contents for c in (func.__closure__ or ()) if _filled(c)]
        seen += list(func.__defaults__ or ())
    models: dict[str, Any] = {}
    for obj in seen:
        model = obj if _is_model(obj) else getattr(obj, "model", None)
        if _is_model(model):
            models[_model_key(model)] = model
    return models


def _nested_names(code: CodeType) -> set[str]:
    return {n for c in code.co_consts if isinstance(c, CodeType)
            for n in set(c.co_names) | _nested_names(c)}


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _is_model(obj: Any) -> bool:
    return hasattr(obj, "vocab") and hasattr(obj, "runner") and hasattr(obj, "backend")


def _model_key(model: Any) -> str:
    return f"{model.name}|{model.engine}|{tokenizer_id(model.vocab)}"


def _input_text(idx: int, value: Any) -> str:
    """Input ``idx``'s data as JSON text, the same in every process; `CheckpointError` for a
    value with no such text."""
    try:
        return _stable_text(value)
    except (StateFormatError, TypeError, ValueError):
        raise CheckpointError(
            f"input {idx} is a {type(value).__module__}.{type(value).__qualname__}, which a "
            "checkpoint cannot identify across runs; inputs must be JSON values, states, "
            "pydantic models, enums, dataclasses, bytes, or tuples, lists and dicts of those: "
            "pass such data (an id, a path) and let the program look the object up") from None


def _bound_text(bound: Any) -> str:
    """The data partials bind and defaults hold; a model, or an object of one (a
    generator), by its model and type, and other objects by their type (as a global's
    value is not part of the program's identity)."""
    def other(value: Any) -> Any:
        try:
            return _stable(value)
        except StateFormatError:
            model = value if _is_model(value) else getattr(value, "model", None)
            return {"$object": class_name(type(value)),
                    "model": _model_key(model) if _is_model(model) else None}
    return json.dumps(to_json(bound, other), sort_keys=True)


def _stable_text(value: Any) -> str:
    return json.dumps(to_json(value, _stable), sort_keys=True)


def _stable(value: Any) -> Any:
    """`to_json`'s encoder of states (by their saved form), dataclasses and bytes."""
    if isinstance(value, SequenceState):
        return {"$state": _digest(value.dumps().decode())}
    if isinstance(value, bytes):
        return {"$bytes": hashlib.sha256(value).hexdigest()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"$dataclass": class_name(type(value)),
                "fields": {f.name: to_json(getattr(value, f.name), _stable)
                           for f in dataclasses.fields(value)}}
    raise StateFormatError(f"no stable encoding for a {type(value).__name__}")


def _digest(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _short(text: str | None) -> str:
    return repr(text if text is None or len(text) <= 40 else text[:37] + "...")
