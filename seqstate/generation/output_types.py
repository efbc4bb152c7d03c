"""``ss.continuous``: outlines 1.x generators and output types as seqstate generators.

Output types and outlines' logits processors are dispatched by type
(`functools.singledispatch`): a new kind is one more registered function.
"""

from __future__ import annotations

import enum
import functools
import typing
import weakref
from typing import Any

from outlines.backends.llguidance import LLGuidanceLogitsProcessor
from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor
from outlines.generator import SteerableGenerator
from outlines.types import CFG, JsonSchema, Regex

from seqstate.constraints.grammar import GrammarConstraint
from seqstate.constraints.regex_constraint import RegexConstraint
from seqstate.errors import ArgumentError
from seqstate.generation.constructors import cfg, choice, json, regex, text
from seqstate.generation.generator import Generator
from seqstate.models.base import BaseModel as Model
from seqstate import models

__all__ = ["continuous", "for_output_type"]

_PY_TYPES = {int: r"-?(0|[1-9][0-9]*)", float: r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
             bool: r"(true|false)"}


# the seqstate model (and its KV store) of each outlines model wrapped: it lives as long as
# the outlines model does, without writing anything onto the user's object
_MODELS: weakref.WeakKeyDictionary[Any, Model] = weakref.WeakKeyDictionary()


def continuous(generator_or_model: Any, output_type: Any = None) -> Generator:
    """Wrap an outlines 1.x steerable generator, or ``(model, output_type)``, as a seqstate generator.

    ``continuous(model, output_type)`` compiles ``output_type`` with seqstate's own byte-exact
    compilation (str, int, float, bool, Literal, Enum, list of options, pydantic models, dicts,
    outlines ``Regex``/``CFG``/``JsonSchema`` terms).  ``continuous(outlines.Generator(om, T))``
    reuses the generator's compiled index or grammar on the same HF model.
    """
    if isinstance(generator_or_model, Model):
        return for_output_type(output_type, generator_or_model)
    gen = generator_or_model
    if not isinstance(gen, SteerableGenerator):
        raise ArgumentError(f"continuous() takes an outlines steerable Generator (such as "
                            f"outlines.Generator(model, output_type) on an outlines Transformers "
                            f"model) or (seqstate model, output_type), got "
                            f"{type(gen).__name__}; pass a seqstate model with the output type")
    om = gen.model
    model = _MODELS.get(om)
    if model is None:
        model = _MODELS[om] = models.from_outlines(om)
    return _from_processor(gen.logits_processor, model)



# -- output types ------------------------------------------------------------------------------
@functools.singledispatch
def for_output_type(output_type: Any, model: Model) -> Generator:
    """The generator of ``output_type`` on ``model``: a ``Literal[...]`` is a choice, and
    anything not registered is a JSON schema (a dict or a JSON-schema string)."""
    if typing.get_origin(output_type) is typing.Literal:
        return choice(model, output_type)
    return json(model, output_type)


@for_output_type.register(type)
def _class(output_type: type, model: Model) -> Generator:
    """str is free text, int/float/bool their JSON spelling; other classes (pydantic models)
    JSON schemas."""
    if output_type is str:
        return text(model)
    if output_type in _PY_TYPES:
        return regex(model, _PY_TYPES[output_type])
    return json(model, output_type)


@for_output_type.register(type(None))
def _none(output_type: None, model: Model) -> Generator:
    return text(model)


@for_output_type.register(enum.EnumMeta)
@for_output_type.register(list)
@for_output_type.register(tuple)
def _options(output_type: Any, model: Model) -> Generator:
    return choice(model, output_type)


@for_output_type.register(Regex)
def _regex(output_type: Regex, model: Model) -> Generator:
    return regex(model, output_type.pattern)


@for_output_type.register(CFG)
def _cfg(output_type: CFG, model: Model) -> Generator:
    return cfg(model, output_type.definition)


@for_output_type.register(JsonSchema)
def _json_schema(output_type: JsonSchema, model: Model) -> Generator:
    return json(model, output_type.schema)


# -- outlines generators -----------------------------------------------------------------------
@functools.singledispatch
def _from_processor(processor: Any, model: Model) -> Generator:
    raise ArgumentError(f"continuous() wraps outlines generators whose logits processor is "
                        f"outlines_core's or llguidance's, got {type(processor).__name__}; use "
                        f"continuous(model, output_type) instead")


@_from_processor.register(type(None))
def _unconstrained(processor: None, model: Model) -> Generator:
    return text(model)


@_from_processor.register(OutlinesCoreLogitsProcessor)
def _index(processor: OutlinesCoreLogitsProcessor, model: Model) -> Generator:
    return Generator(model, RegexConstraint.from_index(processor.index, model), "outlines")


@_from_processor.register(LLGuidanceLogitsProcessor)
def _grammar(processor: LLGuidanceLogitsProcessor, model: Model) -> Generator:
    return Generator(model, GrammarConstraint.from_serialized(processor.grammar, model),
                     "outlines")
