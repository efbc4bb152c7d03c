"""Constraints: compiled once per (spec, tokenizer), one immutable cursor per row and token."""

from seqstate.constraints.base import Constraint, Cursor
from seqstate.constraints.compile import cfg, choice, json_schema, options_of, regex
from seqstate.constraints.grammar import GrammarConstraint
from seqstate.constraints.regex_constraint import RegexConstraint

__all__ = ["Constraint", "Cursor", "RegexConstraint", "GrammarConstraint", "regex", "choice",
           "json_schema", "cfg", "options_of"]
