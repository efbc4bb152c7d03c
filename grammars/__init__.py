"""Lark grammars shipped with seqstate: ``ss.grammars.load("arithmetic")``."""

from __future__ import annotations

import difflib
from importlib import resources

from seqstate.errors import ArgumentError

__all__ = ["load", "available", "GrammarNotFound"]


def available() -> list[str]:
    """Names of the grammars shipped with seqstate."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".lark"))


def load(name: str) -> str:
    """The Lark text of a shipped grammar.

    Examples
    --------
    >>> import seqstate as ss
    >>> "start" in ss.grammars.load("arithmetic")
    True
    """
    names = available()
    if name not in names:
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise GrammarNotFound(f"no grammar named {name!r}; {hint}shipped grammars: "
                              f"{', '.join(names)} (ss.grammars.available())")
    return (resources.files(__name__) / f"{name}.lark").read_text()


class GrammarNotFound(ArgumentError, KeyError):
    """No shipped grammar has this name (a `seqstate.ArgumentError`, and a ``KeyError`` as
    before)."""

    def __str__(self) -> str:           # KeyError's would quote the message
        return str(self.args[0])
