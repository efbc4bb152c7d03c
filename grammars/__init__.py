"""Lark grammars shipped with seqstate: ``ss.grammars.load("arithmetic")``."""

from __future__ import annotations

from importlib import resources

__all__ = ["load", "available"]


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
    path = resources.files(__name__) / f"{name}.lark"
    if not path.is_file():
        raise KeyError(f"no grammar named {name!r}; shipped grammars: {', '.join(available())}")
    return path.read_text()
