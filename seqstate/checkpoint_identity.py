"""What a checkpoint belongs to: the run's identity, written into the checkpoint when it is
made and compared when it is opened again (`seqstate.checkpoint` stores the results).

A run is its program, the models the program uses and its input list:

- the program: the ``key=`` the user gives, where given (the user decides what counts);
  otherwise its qualified name and a digest of its source text (``inspect.getsource``:
  the ``def`` through its last line, comments and docstring included), and the data a
  ``functools.partial`` binds or its defaults hold.  Not its bytecode (a new Python reads
  the same source), nor the helpers it calls or the globals it reads: an edited helper
  leaves the program's identity as it was;
- the models: name, engine and tokenizer digest of each model the program reads through a
  name (a global, a closure cell, a default, a partial's argument, a generator's model);
- the inputs: each one's data (JSON values, states by their saved form, pydantic models,
  enums, dataclasses, bytes, and tuples, lists and dicts of those).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any

from seqstate.errors import ArgumentError, CheckpointError, StateFormatError
from seqstate.persist import class_name, to_json, tokenizer_id
from seqstate.state import SequenceState

__all__ = ["run_identity", "program_id", "models_of", "input_key", "model_key", "is_model",
           "digest"]


def run_identity(program: Callable, key: str | None, models: dict[str, Any],
                 inputs: Sequence[str], version: int) -> dict[str, str]:
    """The identity a checkpoint records: format version, program, models, input list."""
    return {"version": str(version), "program": program_id(program, key),
            "models": json.dumps(sorted(models)), "inputs": digest(list(inputs)),
            "count": str(len(inputs))}


def program_id(program: Callable, key: str | None = None) -> str:
    """``key:<key>`` where the user names the program; otherwise its qualified name and a
    digest of its source and of the data partials bind and its defaults hold."""
    if key is not None:
        if not isinstance(key, str) or not key:
            raise ArgumentError(f"key must be a non-empty string naming the run's program "
                                f"(such as 'extract-v2'), got {key!r}")
        return f"key:{key}"
    func, bound = program, []
    while isinstance(func, functools.partial):
        bound.append([func.args, func.keywords])
        func = func.func
    defaults = [getattr(func, "__defaults__", None), getattr(func, "__kwdefaults__", None)]
    if any(defaults):
        bound.append(defaults)
    qualname = getattr(func, "__qualname__", type(func).__name__)
    name = f"{getattr(func, '__module__', '?')}.{qualname}"
    text = (_source(func, name) if hasattr(func, "__code__") else "") + (
        _bound_text(bound) if bound else "")
    return f"{name}:{digest(text)}" if text else name


def _source(func: Callable, name: str) -> str:
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        raise CheckpointError(f"the source of the program {name} cannot be read (defined in "
                              "an interactive prompt or by exec?), and a checkpoint identifies "
                              "a program by its source: name it instead, with run_batch(..., "
                              "key='my-run')") from None


def models_of(program: Callable) -> dict[str, Any]:
    """The models a program uses, by `model_key`: those it reads through names (globals,
    closure cells, defaults, a partial's arguments), directly or as a generator's model."""
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
        model = obj if is_model(obj) else getattr(obj, "model", None)
        if is_model(model):
            models[model_key(model)] = model
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


def is_model(obj: Any) -> bool:
    """Whether ``obj`` is a model (of any engine)."""
    return hasattr(obj, "vocab") and hasattr(obj, "runner") and hasattr(obj, "backend")


def model_key(model: Any) -> str:
    """A model's identity: name, engine, tokenizer digest."""
    return f"{model.name}|{model.engine}|{tokenizer_id(model.vocab)}"


def input_key(idx: int, value: Any) -> str:
    """A digest of input ``idx``'s data, the same in every process; `CheckpointError` for a
    value with no such data."""
    try:
        return digest(_stable_text(value))
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
            model = value if is_model(value) else getattr(value, "model", None)
            return {"$object": class_name(type(value)),
                    "model": model_key(model) if is_model(model) else None}
    return json.dumps(to_json(bound, other), sort_keys=True)


def _stable_text(value: Any) -> str:
    return json.dumps(to_json(value, _stable), sort_keys=True)


def _stable(value: Any) -> Any:
    """`to_json`'s encoder of states (by their saved form), dataclasses and bytes."""
    if isinstance(value, SequenceState):
        return {"$state": digest(value.dumps().decode())}
    if isinstance(value, bytes):
        return {"$bytes": hashlib.sha256(value).hexdigest()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"$dataclass": class_name(type(value)),
                "fields": {f.name: to_json(getattr(value, f.name), _stable)
                           for f in dataclasses.fields(value)}}
    raise StateFormatError(f"no stable encoding for a {type(value).__name__}")


def digest(value: Any) -> str:
    """A short sha256 of text, or of a JSON value's text."""
    text = value if isinstance(value, str) else json.dumps(value)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
