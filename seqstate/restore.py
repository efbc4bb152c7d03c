"""States made from data from outside the process: ``ss.loads`` (a saved state, ``state.dumps()``
or a pickled one, as a state of a model) and ``ss.from_tokens`` (token ids)."""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Iterable, Sequence
from typing import Any

from seqstate.conversation import Conversation
from seqstate.errors import ArgumentError, ModelMismatch, StateFormatError
from seqstate.persist import Classes, SavedState, decode_rows, read, tokenizer_id
from seqstate.rows import Row
from seqstate.state import SequenceState

__all__ = ["loads", "SavedState", "from_tokens"]


def loads(model: Any, data: bytes | SavedState, *, types: Iterable[type] = ()) -> SequenceState:
    """The state ``state.dumps()`` saved, on ``model``.

    It continues exactly as the saved state would have: a call on it gives the same greedy
    tokens, and ``gen.resume(state)`` resumes its last call, the constraint's cursor
    recreated by replaying the call's tokens.  Its KV is not in ``data``: it is computed
    once, when first needed, from the tokens (or found stored).  Reading runs no code named
    in the data.

    A state travels through ``pickle`` too: ``pickle.loads`` gives a `SavedState` (a model
    does not travel in a pickle), which this function binds to ``model``.

    Parameters
    ----------
    model
        A model with the tokenizer the state was saved under (any engine).
    data : bytes or SavedState
        What ``state.dumps()`` returned, or what ``pickle.loads`` gave for a pickled state.
    types : iterable of classes, optional
        Pydantic models and enums to rebuild values of: a value saved from one of these
        classes is re-validated into it; other such values stay their JSON (a dict).  A
        class matches the saved ``module:qualname``, or its qualified name alone where the
        class was saved from, or is given from, ``__main__`` (a script's own classes).

    Raises
    ------
    ModelMismatch
        ``model`` has another tokenizer than the one the state was saved under.
    StateFormatError
        ``data`` is not a saved state, one of a newer format version, or a damaged one:
        its digest does not match its content, or it holds a token id outside ``model``'s
        vocabulary; or ``types`` were given and none matched the classes the values were
        saved from.

    Examples
    --------
    >>> import pickle
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> s = ss.text(model)("Once upon a time", max_tokens=4)
    >>> ss.loads(model, pickle.loads(pickle.dumps(s))).texts == s.texts
    True
    """
    doc = read(data)
    if not hasattr(model, "vocab"):
        raise ArgumentError(f"ss.loads(model, data) takes the model first, got "
                            f"{type(model).__name__}")
    here = tokenizer_id(model.vocab)
    if doc["tokenizer"] != here:
        saved = doc.get("model")
        why = (f"saved under a model also named {saved!r} whose tokenizer differs from this "
               f"one's (another revision, or tokens added or changed: tokenizer digest "
               f"{doc['tokenizer'][:12]} saved, {here[:12]} here)" if saved == model.name
               else f"saved under {saved!r}, whose tokenizer is not {model.name!r}'s")
        raise ModelMismatch(f"this state was {why}; load it on a model with the tokenizer it "
                            "was saved under")
    classes = Classes(types)
    rows, batch, samples = decode_rows(doc, Conversation, classes)
    if (unmatched := classes.unmatched()) is not None:
        raise StateFormatError(unmatched)
    size = model.vocab.size
    for i, row in enumerate(rows):
        if any(not 0 <= t < size for t in row.tokens):
            raise StateFormatError(f"a damaged saved state: row {i} holds a token id outside "
                                   f"{model.name!r}'s vocabulary (0..{size - 1})")
    return SequenceState(model, tuple(rows), batch, samples)


def from_tokens(model: Any, token_ids: Sequence[Sequence[int]]) -> SequenceState:
    """A ``(len(token_ids), 1)`` state of the given token ids; stored KV is found when generating.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> ss.from_tokens(model, [[1, 2, 3], [4]]).shape
    (2, 1)
    """
    try:
        # operator.index takes ints, numpy ints and integer tensors; floats and str are refused
        rows_ids = [tuple(operator.index(t) for t in ids) for ids in token_ids]
    except TypeError:
        rows_ids = None
    if not rows_ids:
        raise ArgumentError(f"from_tokens takes one list of int token ids per batch item, at "
                            f"least one (an empty prompt is [[]]), got {reprlib.repr(token_ids)}")
    size = model.vocab.size
    rows = []
    for ids in rows_ids:
        bad = [t for t in ids if not 0 <= t < size]
        if bad:
            raise ArgumentError(f"token ids {bad[:5]} are outside the vocabulary (0..{size - 1}) "
                                f"of {model.name}; were they made by another tokenizer?")
        rows.append(Row.plain(ids))
    return SequenceState(model, tuple(rows), len(rows), 1)
