"""Generators: a prompt or a state in, a new ``SequenceState`` out.

``ss.text``, ``ss.choice``, ``ss.regex``, ``ss.json`` and ``ss.cfg`` build a `Generator`;
``ss.continuous`` wraps an outlines 1.x generator or ``(model, output_type)``.  Each call
constrains only the new suffix, so generators mix freely on one state.

One concept per module: `generator` (the `Generator` and its call / stream / resume),
`prompts` (prompts to rows, forks, requests), `healing` (token healing), `streaming`
(stream chunks, `final_state`), `beam` (beam-search calls), `scoring` (option scoring),
`capabilities` (what a call needs of the engine), `constructors` and `output_types`
(``continuous()`` and its dispatch).
"""

from seqstate.generation.constructors import cfg, choice, json, regex, text
from seqstate.generation.generator import Generator
from seqstate.generation.output_types import continuous
from seqstate.generation.ranked_choice import ScoredChoice
from seqstate.generation.streaming import final_state

__all__ = ["Generator", "ScoredChoice", "text", "choice", "regex", "json", "cfg", "continuous",
           "final_state"]
