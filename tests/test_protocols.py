"""The members generators rely on are declared by small base classes, not probed for.

Constraints and cursors (`seqstate.constraints.base`), samplers (`seqstate.sampling.Sampler`)
and hooks (`seqstate.hooks.Hook`) give defaults for what an implementation may leave out;
output types and outlines' processors are dispatched by type.
"""

import dataclasses
import enum
import pathlib
import re
from typing import Literal

import pydantic
import pytest
import torch

import seqstate as ss
from conftest import collect
from seqstate.constraints.base import Constraint, Cursor
from seqstate.constraints.healing import HealingCursor
from seqstate.constraints.regex_constraint import RegexConstraint
from seqstate.generation.output_types import for_output_type
from seqstate.hooks import Hook, as_hook
from seqstate.sampling import Sampler

ROOT = pathlib.Path(ss.__file__).parent


# -- constraints and cursors -------------------------------------------------------------------
def test_every_constraint_and_cursor_is_declared(tiny):
    made = {"regex": ss.regex(tiny, "[ab]{2}").constraint,
            "choice": ss.choice(tiny, ["p", "q"]).constraint,
            "json": ss.json(tiny, {"type": "integer"}).constraint,
            "cfg": ss.cfg(tiny, 'start: "x" | "y"').constraint}
    for name, constraint in made.items():
        assert isinstance(constraint, Constraint), name
        cursor = constraint.start()
        assert isinstance(cursor, Cursor) and cursor.compiled() is constraint, name
        assert isinstance(cursor.draft(), tuple), name
    assert made["regex"].pattern == "[ab]{2}" and made["choice"].pattern == "(p|q)"
    assert made["json"].pattern is None and made["cfg"].pattern is None
    assert made["regex"].validate("ab") is None and made["cfg"].validate("x") is None
    healing = HealingCursor(tiny.vocab, b"ab")
    assert isinstance(healing, Cursor)
    assert healing.compiled() is None and healing.draft() == ()


def test_a_regex_prefixes_itself_unless_its_pattern_is_unknown(tiny):
    regex = ss.regex(tiny, "[0-9]{2}").constraint
    prefixed = regex.prefixed("n=")
    assert prefixed.pattern == "n=([0-9]{2})" and prefixed.parse("n=42") == "42"
    wrapped = RegexConstraint.from_index(regex.index, tiny)
    assert wrapped.pattern is None and wrapped.prefixed("n=") is None
    with pytest.raises(ss.ConstraintError, match="an outlines index"):
        wrapped.start().advance(tiny.encode("x")[0])


class _Upper(Constraint):
    """The smallest user constraint: ``start`` and ``parse``; the rest are the defaults."""

    def __init__(self, inner: Constraint) -> None:
        self.inner = inner

    def start(self) -> Cursor:
        return _UpperCursor(self, self.inner.start())

    def parse(self, text: str) -> object:
        return text.upper()


@dataclasses.dataclass(frozen=True)
class _UpperCursor(Cursor):
    owner: _Upper
    at: Cursor

    def compiled(self) -> Constraint:
        return self.owner

    def allowed(self) -> torch.Tensor:
        return self.at.allowed()

    def advance(self, token: int) -> Cursor:
        return _UpperCursor(self.owner, self.at.advance(token))

    @property
    def accepting(self) -> bool:
        return self.at.accepting

    @property
    def complete(self) -> bool:
        return self.at.complete


def test_a_user_constraint_runs_on_the_defaults(tiny):
    gen = ss.Generator(tiny, _Upper(ss.constraints.regex(tiny, "[ab]{2}")), "upper")
    s = gen("Letters: ")
    assert s.finish_reason == "constraint_complete" and re.fullmatch("[AB]{2}", s.value)
    with pytest.raises(ss.ConstraintError, match="cannot be prefixed"):
        gen("The url is http", token_healing=True)
    with pytest.raises(TypeError):
        Cursor()                                  # the abstract members are required


# -- samplers ----------------------------------------------------------------------------------
def test_samplers_declare_whether_they_need_history():
    assert not ss.greedy().needs_history and not ss.beam_search(2).needs_history
    assert not ss.multinomial().needs_history
    assert ss.multinomial(repetition_penalty=1.3).needs_history
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    history = [((1, 2), 1), ((0,), 0)]
    for sampler in (ss.greedy(), ss.multinomial(temperature=0.01), ss.beam_search(2)):
        assert isinstance(sampler, Sampler)
        chosen = sampler.choose(logits, torch.Generator().manual_seed(0), history)
        assert chosen.tolist() == [1, 0]


class _Lowest(Sampler):
    """The allowed token with the lowest id."""

    def choose(self, logits, rng, history=None):
        return torch.isfinite(logits).int().argmax(-1)


def test_a_user_sampler_subclasses_sampler(tiny):
    s = ss.regex(tiny, "[0-9]{3}")("n=", sampler=_Lowest())
    assert re.fullmatch("[0-9]{3}", s.value)

    class Duck:
        def choose(self, logits, rng, history=None):
            return logits.argmax(-1)

    with pytest.raises(ss.ArgumentError, match="sampler"):
        ss.text(tiny)("x", sampler=Duck())


# -- hooks -------------------------------------------------------------------------------------
def test_hooks_declare_lookback_and_forced_by():
    ban = ss.hooks.ban_phrases(["xyz", "ab"])
    assert isinstance(ban, Hook) and as_hook(ban) is ban
    assert ban.lookback == 3 and ban.forced_by("xyz[0-9]") and not ban.forced_by("[0-9]+")

    def plain(event):
        return None

    assert as_hook(plain).lookback is None and not as_hook(plain).forced_by("xyz")
    plain.lookback = 0                      # the documented declaration on a plain function
    assert as_hook(plain).lookback == 0
    assert repr(as_hook(plain)) == repr(plain)


class _Quiet(Hook):
    """A hook that never rolls back, and says so."""

    lookback = 0

    def __call__(self, event):
        return None


def test_a_hook_with_no_lookback_streams_as_it_goes(tiny):
    chunks, state = collect(ss.text(tiny).stream("Once", max_tokens=12, hooks=[_Quiet()]))
    assert len(chunks) > 1 and "".join(chunks) == state.value


def test_a_forced_banned_phrase_is_refused_before_compute(fresh_tiny):
    before = fresh_tiny.stats
    with pytest.raises(ss.ConstraintError, match="banned phrase"):
        ss.regex(fresh_tiny, "xyz[0-9]")("x", hooks=[ss.hooks.ban_phrases(["xyz"])])
    assert fresh_tiny.stats == before


# -- dispatch by type --------------------------------------------------------------------------
class _Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class _Person(pydantic.BaseModel):
    name: str


def test_output_types_dispatch_by_type(tiny):
    from outlines.types import CFG, JsonSchema, Regex

    kinds = [(str, "text"), (None, "text"), (int, "regex"), (float, "regex"),
             (bool, "regex"), (Literal["a", "b"], "choice"), (_Colour, "choice"),
             (("a", "b"), "choice"), (["a", "b"], "choice"), (Regex("[0-9]"), "regex"),
             (CFG('start: "x"'), "cfg"), (JsonSchema('{"type": "integer"}'), "json"),
             (_Person, "json"), ('{"type": "string"}', "json"), ({"type": "integer"}, "json")]
    for output_type, name in kinds:
        assert for_output_type(output_type, tiny).name == name, output_type
        assert ss.continuous(tiny, output_type).name == name, output_type
    assert ss.continuous(tiny, int).constraint.pattern == r"-?(0|[1-9][0-9]*)"


def test_outlines_processors_dispatch_by_type(tiny):
    import outlines

    om = outlines.from_transformers(tiny.hf_model, tiny.hf_tokenizer)
    yes_no = ss.continuous(outlines.Generator(om, Literal["yes", "no"]))
    assert isinstance(yes_no.constraint, RegexConstraint) and yes_no.name == "outlines"
    assert yes_no("Answer: ").value in ("yes", "no")
    grammar = ss.continuous(outlines.Generator(om, outlines.types.CFG('start: "x" | "y"')))
    assert grammar("Letter: ").value in ("x", "y")
    free = ss.continuous(outlines.Generator(om, None))
    assert free.constraint is None and free.model is yes_no.model is grammar.model
    with pytest.raises(ss.ConstraintError, match="cannot be prefixed"):
        yes_no("The url is http", token_healing=True)
    with pytest.raises(TypeError, match="steerable Generator"):
        ss.continuous(object())


# -- no probes left ----------------------------------------------------------------------------
# The engine and the layers above it read only declared members of cursors, constraints,
# hooks and samplers.  The attribute reads by name that remain, each on something else:
ALLOWED = {
    ("hooks.py", 'getattr(function, "lookback", None)'):
        "a plain function declares lookback as a function attribute (documented)",
    ("conversation.py", 'getattr(tok, "chat_template", None)'): "a tokenizer's template",
    ("state.py", "getattr(self.model, 'name', '?')"): "a repr of a state of any model",
    ("sampling/params.py", "getattr(self, name)"): "a sampler's own fields, by name",
    ("engine/rows.py", "getattr(self, name)"): "a live row's own fields, copied by name",
    ("scores.py", "getattr(self, by)"): "a Scores' own table, by name",
}
SCANNED = ["generation", "engine", "constraints", "sampling", "hooks.py", "call.py", "state.py",
           "rows.py", "scores.py", "conversation.py"]


def test_no_probes_in_the_engine_and_above():
    found = set()
    for entry in SCANNED:
        paths = [ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).glob("*.py"))
        for path in paths:
            for line in path.read_text().splitlines():
                for call in re.findall(r"(?:has|get)attr\([^()]*(?:\([^()]*\))?[^()]*\)", line):
                    found.add((path.relative_to(ROOT).as_posix(), call))
    assert found - set(ALLOWED) == set(), "attribute probes: declare the member instead"
