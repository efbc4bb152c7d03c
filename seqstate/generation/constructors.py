"""The generators users build: free text, a choice, a regex, JSON and a Lark grammar."""

from __future__ import annotations

from typing import Any

from seqstate.constraints import compile as compiled
from seqstate.errors import ArgumentError
from seqstate.generation.generator import Generator
from seqstate.generation.ranked_choice import ScoredChoice
from seqstate.models.base import BaseModel as Model

__all__ = ["text", "choice", "regex", "json", "cfg"]


def text(model: Model) -> Generator:
    """Free text.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> ss.text(model)("Once upon a time", max_tokens=3).shape
    (1, 1)
    """
    return Generator(model, None, "text")


def choice(model: Model, options: Any, *, method: str = "generate",
           length_normalize: bool = True) -> Generator:
    """One of ``options`` (a list of str, a ``Literal[...]`` or an ``Enum``); value is the option.

    ``method="generate"`` (default) decodes under the options' constraint.  ``method="score"``
    ranks every whole option by its log-prob given the state (mean per token with
    ``length_normalize``, else the sum), in one batched prefill; ``state.scores`` holds them.
    """
    if method == "score":
        return ScoredChoice(model, options, length_normalize)
    if method != "generate":
        raise ArgumentError(f"choice(method=...) is 'generate' (decode under the options' "
                            f"constraint) or 'score' (rank whole options), got {method!r}")
    return Generator(model, compiled.choice(model, options), "choice")


def regex(model: Model, pattern: str) -> Generator:
    """Text matching ``pattern`` in full."""
    return Generator(model, compiled.regex(model, pattern), "regex")


def json(model: Model, schema: Any, *, whitespace: str = "compact",
         additional_properties: bool = False, key_order: str = "schema") -> Generator:
    """JSON matching ``schema`` (a pydantic model, a dict or a JSON-schema string); value is parsed.

    ``whitespace``: "compact" (at most one space after ``,``/``:``), "pretty" (indented) or
    "flexible" (any JSON whitespace).  ``additional_properties``: whether objects whose
    schema does not say may get keys it does not list.  ``key_order``: "schema" or
    "required_first".  A finished value is validated against the schema with ``jsonschema``;
    one that fails (a keyword only validation checks, such as ``uniqueItems``) finishes with
    ``finish_reason == "invalid"`` and value None.
    """
    return Generator(model, compiled.json_schema(model, schema, whitespace=whitespace,
                                                 additional_properties=additional_properties,
                                                 key_order=key_order), "json")


def cfg(model: Model, grammar: str) -> Generator:
    """Text in the language of a Lark grammar (see ``ss.grammars.load``)."""
    return Generator(model, compiled.cfg(model, grammar), "cfg")
