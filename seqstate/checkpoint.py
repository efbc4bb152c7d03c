"""Durable runs: ``ss.run_batch(program, inputs, checkpoint="run.sqlite")``.

Each input's result is written to an SQLite database (the standard library's, in WAL mode with
full synchronisation) in its own transaction as soon as its program returns, so a run killed
at any moment keeps every result it finished.  Run again with the same checkpoint, finished
inputs get their stored results without their program being called.

A checkpoint belongs to one run: its program (the ``key=`` given, else its qualified name
and source), its models and its input list (`seqstate.checkpoint_identity` says exactly
what counts).  Any other is refused with `seqstate.CheckpointError` before anything runs;
`results` reads a checkpoint's results without the program.

A result is stored as JSON data (states as ``state.dumps()`` does, pydantic models and enums
by class name), with a digest: a row whose digest does not match (a torn write) is run
again, never read.  Classes are rebuilt by the one rule of `seqstate.persist`: only those
the caller gives (``types=``).  A failed input is not stored: a rerun tries it again.  A
result that cannot be stored stops the run at the first one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from seqstate.checkpoint_identity import input_key, model_key, models_of, run_identity
from seqstate.conversation import Conversation
from seqstate.errors import CheckpointError, StateFormatError
from seqstate.persist import (Classes, SavedState, class_name, decode_rows, from_json, read,
                              to_json)
from seqstate.persist import tokenizer_id
from seqstate.state import SequenceState

__all__ = ["Checkpoint", "checkpoint_results"]

VERSION = 2         # 2: the program by its source or key (1: by its bytecode)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    idx INTEGER PRIMARY KEY, input TEXT NOT NULL, data BLOB NOT NULL, digest TEXT NOT NULL);
"""


def checkpoint_results(path: str | os.PathLike, *, models: Iterable[Any] = (),
                       types: Iterable[type] = ()) -> dict[int, Any]:
    """The results a checkpoint holds, by input index, read without its program (a
    checkpoint another program's run refuses stays readable).

    Parameters
    ----------
    path : str or os.PathLike
        A checkpoint ``run_batch`` wrote.
    models : iterable of models, optional
        A stored state whose model (name and tokenizer) is among these comes back as a state
        of it; any other as a `seqstate.SavedState` (``ss.loads(model, saved)`` binds it).
    types : iterable of classes, optional
        Pydantic models and enums to rebuild values of (as ``ss.loads`` does); values of
        other classes stay their JSON.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> import seqstate as ss
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.sqlite"
    >>> ss.run_batch(len, ["ab", "abc"], checkpoint=path, key="lengths",
    ...              progress=False)
    [2, 3]
    >>> ss.checkpoint_results(path)
    {0: 2, 1: 3}
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint file at {str(path)!r}")
    models, given = list(models), Classes(types)

    def state(data: dict) -> Any:
        doc = _state_doc(data)
        model = next((m for m in models if _belongs(doc, m)), None)
        return SavedState(json.dumps(doc).encode()) if model is None else \
            _state(doc, model, given)

    with contextlib.closing(_connect(_read_only(path), path, uri=True)) as db:
        with _sqlite_errors(path, "read"):
            rows = db.execute("SELECT idx, input, data, digest FROM results").fetchall()
    out = {}
    for idx, _, data, _ in _intact(rows):
        try:
            out[idx] = from_json(json.loads(data), given, state)
        except (ValueError, StateFormatError):
            continue                    # unreadable: as a run would run it again
    return dict(sorted(out.items()))


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
    key : str or None, default None
        The program's name for the checkpoint; None: its qualified name and source.
    types : iterable of classes, optional
        The pydantic models and enums results hold (the classes a resumed run rebuilds).
    """

    def __init__(self, path: Any, program: Callable, inputs: Sequence[Any], *,
                 key: str | None = None, types: Iterable[type] = ()) -> None:
        self.path = path
        self.models = models_of(program)
        self.classes = Classes(types)
        self.inputs = [input_key(i, x) for i, x in enumerate(inputs)]
        identity = run_identity(program, key, self.models, self.inputs, VERSION)
        self._lock = threading.Lock()
        self._db = _connect(path, path)
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
                    f"(stored {_short(stored.get(key))}, this run {_short(identity[key])})"
                    f"{_hint(key, stored.get(key))}; pass another checkpoint path, or delete "
                    "this file to start over.  Its results stay readable without the program: "
                    f"ss.checkpoint_results({str(self.path)!r})")

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

    def _sqlite_errors(self, doing: str) -> contextlib.AbstractContextManager:
        return _sqlite_errors(self.path, doing)

    # -- results -----------------------------------------------------------------------------
    def finished(self) -> dict[int, Any]:
        """The stored results by input index; rows that fail their digest are left out (their
        inputs run again).  `CheckpointError` where they hold values of classes not among
        ``types``."""
        with self._lock, self._sqlite_errors("read"):
            rows = self._db.execute("SELECT idx, input, data, digest FROM results").fetchall()
        classes = Classes(self.classes.given.values())
        out = {}
        for idx, key, data, _ in _intact(rows):
            if 0 <= idx < len(self.inputs) and key == self.inputs[idx]:
                try:
                    out[idx] = from_json(json.loads(data), classes,
                                         lambda d: self._decode_state(d, classes))
                except (ValueError, StateFormatError):
                    continue                    # unreadable: run it again
        if classes.missing:
            raise CheckpointError(
                f"the stored results hold values of {', '.join(sorted(classes.missing))}, "
                "classes not among types=; pass them (run_batch(..., types=[...])), so that "
                "resumed results are rebuilt as the first run returned them")
        return out

    def put(self, idx: int, result: Any) -> None:
        """Store input ``idx``'s result durably (one transaction); `CheckpointError` where it
        cannot be stored."""
        try:
            self._given(result)
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

    def _given(self, value: Any) -> None:
        """Raise `StateFormatError` for a pydantic or enum value whose class is not among
        ``types`` (a resumed run could not rebuild it)."""
        cls = type(value)
        if (hasattr(cls, "model_validate") or hasattr(cls, "_member_map_")) and \
                self.classes.find(class_name(cls)) is not cls:
            raise StateFormatError(f"it holds a {class_name(cls)}, a class not among types=; "
                                   f"pass run_batch(..., types=[{cls.__qualname__}, ...]) so "
                                   "that a resumed run rebuilds it (a class defined at a "
                                   "module's top level)")
        if isinstance(value, (list, tuple)):
            for v in value:
                self._given(v)
        elif isinstance(value, dict):
            for item in value.items():
                self._given(item)

    # -- states ------------------------------------------------------------------------------
    def _encode_state(self, value: Any) -> Any:
        if not isinstance(value, SequenceState):
            raise StateFormatError(f"cannot store a value of type {type(value).__name__} "
                                   f"({value!r:.60}): results are JSON values, states, pydantic "
                                   "models, enums, tuples and dicts of those")
        if model_key(value.model) not in self.models:
            raise StateFormatError(f"the result holds a state of {value.model.name!r}, a model "
                                   "the program does not name (run_batch finds models among "
                                   "the names the program uses); use the model through a name "
                                   "the program reads")
        for row in value.rows:
            for span in row.spans:
                self._given(span.value)
        return {"$state": json.loads(value.dumps())}

    def _decode_state(self, data: dict, classes: Classes) -> Any:
        doc = _state_doc(data)
        for model in self.models.values():
            if _belongs(doc, model):
                return _state(doc, model, classes)
        raise StateFormatError("a stored state's model is not the program's")


def _state_doc(data: dict) -> dict:
    """The saved document of a stored state (`seqstate.persist`'s format, checked)."""
    if "$state" not in data:
        raise StateFormatError(f"unknown tagged value {sorted(data)[:3]} in a checkpoint")
    return read(json.dumps(data["$state"]).encode())


def _belongs(doc: dict, model: Any) -> bool:
    return tokenizer_id(model.vocab) == doc["tokenizer"] and model.name == doc["model"]


def _state(doc: dict, model: Any, classes: Any) -> SequenceState:
    rows, batch, samples = decode_rows(doc, Conversation, classes)
    return SequenceState(model, tuple(rows), batch, samples)


def _intact(rows: list[tuple]) -> list[tuple]:
    """The stored rows whose data matches its digest (a torn write does not)."""
    return [row for row in rows if hashlib.sha256(row[2]).hexdigest() == row[3]]


def _read_only(path: str | os.PathLike) -> str:
    return pathlib.Path(path).resolve().as_uri() + "?mode=ro"


def _connect(target: str | os.PathLike, path: Any, uri: bool = False) -> sqlite3.Connection:
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {str(path)!r} is a directory; give the path of a "
                              "file (in that directory: "
                              f"{os.path.join(os.fspath(path), 'run.sqlite')!r})")
    try:
        return sqlite3.connect(target, check_same_thread=False, isolation_level=None, uri=uri)
    except sqlite3.Error as exc:
        raise CheckpointError(f"cannot open checkpoint {str(path)!r} ({exc}); give the "
                              "path of a checkpoint run_batch wrote, or a new file") from None


@contextlib.contextmanager
def _sqlite_errors(path: Any, doing: str) -> Iterator[None]:
    """SQLite's errors (a locked or full disk, a damaged file) as `CheckpointError`."""
    try:
        yield
    except sqlite3.Error as exc:
        raise CheckpointError(f"cannot {doing} checkpoint {str(path)!r}: {exc}; give the "
                              "path of a checkpoint run_batch wrote, or a new file, on a "
                              "disk with room, that no other run is writing") from None


def _hint(what: str, stored: str | None) -> str:
    """What to do where the program or the format version differs."""
    if what == "program" and stored is not None and stored.startswith("key:"):
        return f" (it was named key={stored[4:]!r}: pass the same key= to resume)"
    if what == "program":
        return (" (a program is its name and source, unless run_batch(..., key=...) names it: "
                "an edited program is another, see seqstate.checkpoint_identity)")
    if what == "version":
        return " (written by an older seqstate, which identified programs by their bytecode)"
    return ""


def _short(text: str | None) -> str:
    return repr(text if text is None or len(text) <= 40 else text[:37] + "...")
