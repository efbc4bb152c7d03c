"""Why a regex could not be compiled, in words a user can act on.

outlines_core reports every failure of its automaton builder as "Failed to build DFA" and a
pattern that matches nothing as "an encoding issue in your vocabulary".  `explain` is asked
only after a compile failed, and tells apart: a syntax error (with its position), a construct
that an automaton over the text so far cannot express (which one, and what to write instead),
and a pattern whose language is empty.
"""

from __future__ import annotations

import re

import interegular

__all__ = ["explain", "syntax_error", "unsupported_construct", "matches_nothing"]

_SYNTAX_HINT = "fix the pattern (Python `re` syntax)"

_LOOKAROUND = ("a constraint decides each token from the text before it, so it cannot look "
               "around; fold the condition into the pattern (for `\\d+(?=px)` write `\\d+px`) "
               "or check the finished text with a hook (ss.hooks)")
_BACKREF = ("an automaton cannot remember what a group matched; repeat the group's pattern "
            "instead (`(a|b)\\1` -> `aa|bb` if both must be equal, else `(a|b)(a|b)`)")
_BOUNDARY = ("spell the boundary out: a space or a class such as `[^A-Za-z0-9_]`, or rely on "
             "the pattern's ends (the whole generated text must match)")
_ATOMIC = ("write an ordinary group `(?:...)` or quantifier: a constraint allows every text of "
           "the language, so backtracking control changes nothing")

# group openers a token automaton cannot express: (opening text, name, what to do instead)
_GROUPS = (
    ("(?<=", "the lookbehind `(?<=...)`", _LOOKAROUND),
    ("(?<!", "the negative lookbehind `(?<!...)`", _LOOKAROUND),
    ("(?=", "the lookahead `(?=...)`", _LOOKAROUND),
    ("(?!", "the negative lookahead `(?!...)`", _LOOKAROUND),
    ("(?P=", "the named backreference `(?P=name)`", _BACKREF),
    ("(?(", "the conditional group `(?(id)yes|no)`", "write the alternatives out with `|`"),
    ("(?>", "the atomic group `(?>...)`", _ATOMIC),
)


def syntax_error(pattern: str) -> str | None:
    """The message for a pattern Python's ``re`` cannot parse, with its position; else None."""
    try:
        re.compile(pattern)
    except re.error as exc:
        pos = exc.pos if exc.pos is not None else len(pattern)
        return (f"regex syntax error at position {pos}: {exc.msg} (expected a valid regular "
                f"expression, got {pattern!r}); {_SYNTAX_HINT}:\n    {pattern}\n"
                f"    {' ' * pos}^")
    return None


def unsupported_construct(pattern: str) -> str | None:
    """The message for the first construct of ``pattern`` no automaton can express; else None.

    A scan of the text outside character classes: backslash escapes are skipped whole, so
    ``\\(?=`` is a literal parenthesis, and ``[(?=]`` a class.
    """
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1: i + 2]
            if not in_class and nxt in tuple("123456789"):
                return _unsupported(pattern, i, f"the backreference `\\{nxt}`", _BACKREF)
            if not in_class and nxt in ("b", "B"):
                return _unsupported(pattern, i, f"the word boundary `\\{nxt}`", _BOUNDARY)
            i += 2
            continue
        if in_class:
            in_class = c != "]"
            i += 1
            continue
        if c == "[":
            # a `]` right after `[` or `[^` is a literal member of the class
            i += 2 if pattern[i + 1: i + 2] == "^" else 1
            i += 1 if pattern[i: i + 1] == "]" else 0
            in_class = True
            continue
        if c == "(":
            for opener, name, instead in _GROUPS:
                if pattern.startswith(opener, i):
                    return _unsupported(pattern, i, name, instead)
        i += 1
    return None


def _unsupported(pattern: str, pos: int, name: str, instead: str) -> str:
    return (f"regex {pattern!r} uses {name} at position {pos}, which a token constraint cannot "
            f"express (it needs a regular language without lookaround, backreferences or word "
            f"boundaries); {instead}:\n    {pattern}\n    {' ' * pos}^")


def matches_nothing(pattern: str) -> bool:
    """Whether no string at all matches ``pattern`` (False when interegular cannot tell)."""
    try:
        return interegular.parse_pattern(pattern).to_fsm().empty()
    except Exception:                   # interegular does not support every construct
        return False


def explain(pattern: str, failure: Exception) -> str:
    """The message for a pattern outlines_core failed to compile with ``failure``."""
    found = syntax_error(pattern) or unsupported_construct(pattern)
    if found:
        return found
    if matches_nothing(pattern):
        return (f"regex {pattern!r} matches no text at all (an empty class such as "
                f"`[^\\s\\S]`, or a part that excludes everything), so no generation can "
                f"satisfy it; check its character classes and alternatives")
    detail = str(failure)
    if "encoding issue" in detail:
        missing = re.search(r"following characters: (\[.*?\])", detail)
        chars = f" {missing.group(1)}" if missing else ""
        return (f"regex {pattern!r} needs a character{chars} that no token of this model's "
                f"vocabulary can spell (special tokens are left out); allow other characters "
                f"at that point, or use a model whose tokenizer covers them")
    return (f"cannot compile regex {pattern!r}: {detail}; {_SYNTAX_HINT}, without lookaround, "
            f"backreferences or word boundaries")
