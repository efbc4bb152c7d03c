"""The generators users build: free text, a choice, a regex, JSON and a Lark grammar.

Each constructor returns a `Generator`; the keywords its calls take are listed in the
constructor's own docstring too ("Other Parameters"), so ``help(ss.text)`` shows them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from seqstate.call import CALL_PARAMETERS
from seqstate.constraints import compile as compiled
from seqstate.errors import ArgumentError
from seqstate.generation.generator import Generator
from seqstate.generation.ranked_choice import ScoredChoice
from seqstate.models.base import BaseModel as Model, require_model

__all__ = ["text", "choice", "regex", "json", "cfg"]

_CALLED = ("Generator\n    Call it with a prompt (a str, a list of str, one per batch item, or "
           "a\n    ``SequenceState``) and the keywords below: ``gen(prompt, **keywords)``, "
           "also\n    ``gen.stream``, ``gen.resume`` and ``await gen.acall``; each returns a "
           "new state.")


def _documents_call(constructor: Callable) -> Callable:
    """Put the generator's call keywords (`seqstate.call.CallOptions`, declared once) in
    ``constructor``'s docstring, before its examples: ``help(ss.text)`` shows them."""
    doc = inspect.cleandoc(constructor.__doc__)
    head, examples = doc.split("Examples\n--------", 1)
    keywords = CALL_PARAMETERS.split("----------\n", 1)[1]
    constructor.__doc__ = (head.rstrip() + "\n\nReturns\n-------\n" + _CALLED
                           + "\n\nOther Parameters\n----------------\n" + keywords
                           + "\n\nExamples\n--------" + examples)
    return constructor


@_documents_call
def text(model: Model) -> Generator:
    r"""A generator of free text: ``ss.text(model)(prompt, max_tokens=30, stop_at="\n")``.

    A call runs each row until EOS, a ``stop_at`` string or ``max_tokens`` (256 when not
    given); ``state.value`` is the text the call wrote (without the stop string).

    Parameters
    ----------
    model : Model
        The model to generate with (``ss.models.default()``, ``ss.models.transformers(...)``).

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> s = ss.text(model)("Once upon a time", max_tokens=3)
    >>> s.shape, s.finish_reason
    ((1, 1), 'max_tokens')
    """
    require_model(model, "ss.text()")
    return Generator(model, None, "text")


@_documents_call
def choice(model: Model, options: Any, *, method: str = "generate",
           length_normalize: bool = True) -> Generator:
    """A generator of one of ``options``; ``state.value`` is the option chosen.

    Parameters
    ----------
    model : Model
        The model to generate with.
    options : list of str, ``Literal[...]`` or ``Enum``
        The options; with a ``Literal`` or an ``Enum``, ``value`` is the literal or member.
    method : {"generate", "score"}, default "generate"
        "generate" decodes under the options' constraint (token by token, greedy by
        default).  "score" ranks every whole option by its log-prob given the state, in one
        batched prefill, and keeps the best; ``state.scores`` holds the ranking.
    length_normalize : bool, default True
        For ``method="score"``: rank by the mean log-prob per token (True) or the sum.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> ss.choice(model, ["yes", "no"])("Answer: ").value in ("yes", "no")
    True
    """
    require_model(model, "ss.choice()")
    if method == "score":
        return ScoredChoice(model, options, length_normalize)
    if method != "generate":
        raise ArgumentError(f"choice(method=...) is 'generate' (decode under the options' "
                            f"constraint) or 'score' (rank whole options), got {method!r}")
    return Generator(model, compiled.choice(model, options), "choice")


@_documents_call
def regex(model: Model, pattern: str) -> Generator:
    r"""A generator of text that matches ``pattern`` in full; ``state.value`` is the text.

    The whole text a call writes matches (``^`` and ``$`` are implied).  The syntax is
    Python's ``re`` without what a token automaton cannot express: no lookahead or
    lookbehind, backreferences, word boundaries (``\b``) or atomic groups.  A pattern that cannot be compiled raises ``ss.ConstraintError`` when the
    generator is built, naming the problem and its position.

    Parameters
    ----------
    model : Model
        The model to generate with.
    pattern : str
        The regular expression.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> s = ss.regex(model, r"[0-9]{3}")("Three digits: ")
    >>> len(s.value), s.value.isdigit()
    (3, True)
    """
    require_model(model, "ss.regex()")
    return Generator(model, compiled.regex(model, pattern), "regex")


@_documents_call
def json(model: Model, schema: Any, *, whitespace: str = "compact",
         additional_properties: bool = False, key_order: str = "schema") -> Generator:
    """A generator of JSON matching ``schema``; ``state.value`` is the parsed value.

    A finished value is validated against the schema with ``jsonschema``; one that fails (a
    keyword only validation checks, such as ``uniqueItems``) finishes with
    ``finish_reason == "invalid"`` and value None.

    Parameters
    ----------
    model : Model
        The model to generate with.
    schema : pydantic model class, dict or str
        The JSON schema; with a pydantic model, ``value`` is an instance of it, else the
        parsed JSON.
    whitespace : {"compact", "pretty", "flexible"}, default "compact"
        At most one space after ``,``/``:``; indented lines; any JSON whitespace.
    additional_properties : bool, default False
        Whether objects whose schema does not say may get keys it does not list.
    key_order : {"schema", "required_first"}, default "schema"
        Properties in the schema's order, or the required ones first.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> schema = {"type": "object", "properties": {"n": {"type": "integer"}},
    ...           "required": ["n"]}
    >>> s = ss.json(model, schema)("A number: ", max_tokens=20)
    >>> s.finish_reason == "max_tokens" or isinstance(s.value["n"], int)
    True
    """
    require_model(model, "ss.json()")
    return Generator(model, compiled.json_schema(model, schema, whitespace=whitespace,
                                                 additional_properties=additional_properties,
                                                 key_order=key_order), "json")


@_documents_call
def cfg(model: Model, grammar: str) -> Generator:
    """A generator of text in the language of a Lark grammar; ``state.value`` is the text.

    Parameters
    ----------
    model : Model
        The model to generate with.
    grammar : str
        Lark grammar text whose ``start`` rule is the whole text (llguidance's Lark dialect:
        terminals may be regexes).  ``ss.grammars.load(name)`` returns a shipped one
        (``ss.grammars.available()`` lists them).

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> calc = ss.cfg(model, ss.grammars.load("arithmetic"))
    >>> s = calc("An expression: ", max_tokens=12)
    >>> isinstance(s.value, str) or s.value is None
    True
    """
    require_model(model, "ss.cfg()")
    return Generator(model, compiled.cfg(model, grammar), "cfg")
