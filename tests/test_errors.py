"""The error hierarchy: every error seqstate raises on purpose is typed.

Two halves.  A walk over every ``raise`` in the package (``ast``) refuses a bare built-in
exception class outside `INTERNAL`, the documented raises a user cannot reach (broken
invariants, abstract methods, protocols of other libraries).  Then each error a user could meet as a built-in before is raised as its typed class, still
an instance of that built-in, so ``except ValueError`` code keeps working.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import pathlib
import re
import warnings
from typing import NamedTuple

import pytest
import torch

import seqstate as ss
from seqstate import errors
from seqstate.engine import Stepper
from seqstate.generation.output_types import _from_processor

PACKAGE = pathlib.Path(ss.__file__).parent
ROOT = PACKAGE.parent
BUILTIN_ERRORS = frozenset(n for n, v in vars(builtins).items()
                           if isinstance(v, type) and issubclass(v, BaseException))

# plugins/seqstate-vllm is not walked: a separate distribution that runs inside the vLLM
# server and never imports seqstate.  Its ValueErrors are vLLM's contract for refusing a
# request (HTTP 400), which seqstate's client turns into typed errors (backends/vllm/client.py).

_CORRUPT = "store corruption, as verify() finds it; no input leads here, it means a seqstate bug"
_PROTOCOL = ("a caller breaking the store/batch protocol; only seqstate's own engine calls it, "
             "and it checks user input before (empty rows become the start token)")

# (file, function, exception) -> why no user input reaches it.  The function is a qualname,
# or "Class.*" for every method of a class that only seqstate's engine calls (a KV store, a
# radix tree, an engine's batch), so that renaming a method there needs no edit here.
INTERNAL: dict[tuple[str, str, str], str] = {
    ("seqstate/radix/tree.py", "RadixTree.*", "ValueError"): _PROTOCOL,
    ("seqstate/backends/hf/store.py", "KVStore.*", "RuntimeError"): _PROTOCOL,
    ("seqstate/backends/hf/store.py", "_check_segment", "RuntimeError"): _CORRUPT,
    ("seqstate/backends/llamacpp/backend.py", "LlamaCppBackend.ensure_kv", "ValueError"):
        _PROTOCOL,
    ("seqstate/backends/llamacpp/batch.py", "LlamaCppBatch.*", "KeyError"): _PROTOCOL,
    ("seqstate/backends/llamacpp/batch.py", "LlamaCppBatch.*", "ValueError"): _PROTOCOL,
    ("seqstate/backends/llamacpp/batch.py", "LlamaCppBatch.*", "RuntimeError"): _PROTOCOL,
    ("seqstate/backends/llamacpp/native.py", "Llama.compact", "RuntimeError"):
        "llama.cpp failing to load back the state it copied out a moment before (its bug)",
    ("seqstate/backends/llamacpp/native.py", "Llama._state", "RuntimeError"):
        "llama.cpp copying out fewer bytes than it sized a moment before (its bug)",
    ("seqstate/backends/llamacpp/native.py", "Llama.cell_positions", "RuntimeError"):
        "reads the cell layout for verify() only: " + _CORRUPT,
    ("seqstate/backends/llamacpp/store.py", "SeqStore.*", "RuntimeError"): _PROTOCOL,
    ("seqstate/backends/teacher_forcing.py", "prefix_groups", "ValueError"): _PROTOCOL,
    ("seqstate/backends/teacher_forcing.py", "score_pairs", "ValueError"):
        "empty continuations are refused with ArgumentError/ConstraintError before (scores.py, "
        "choice options); " + _PROTOCOL,
    ("seqstate/backends/hf/packed.py", "score_packed", "ValueError"):
        "the same check as score_pairs on the HF engine's packed path; " + _PROTOCOL,
    ("seqstate/engine/scheduler.py", "Scheduler._receive", "RuntimeError"):
        "the worker thread reports every exception of a call to it; this is a worker that "
        "died without reporting (a seqstate bug), and the next call starts a new one",
    ("seqstate/rows.py", "Chat.turn", "NotImplementedError"):
        "an abstract method with a message: every chat record is a conversation.Conversation",
    ("seqstate/rows.py", "Chat.reply", "NotImplementedError"):
        "an abstract method with a message: every chat record is a conversation.Conversation",
    ("seqstate/backends/vllm/pool.py", "Pool.call", "AssertionError"):
        "after the loop over attempts, which raises EngineError when none is left: unreachable",
    ("seqstate/backends/vllm/pool.py", "Pool.post", "AssertionError"):
        "after the first step of a request that streams nothing: unreachable",
    ("seqstate/constraints/grammar.py", "_Tokens.__call__", "TypeError"):
        "llguidance's protocol: it probes the tokenizer with bytes and expects TypeError",
    ("seqstate/constraints/grammar.py", "GrammarConstraint.parse", "ValueError"):
        "caught by Generator._parse: an invalid complete value becomes value None",
    ("seqstate/constraints/json_constraint.py", "_no_duplicates", "ValueError"):
        "json.loads' object_pairs_hook protocol; caught in JsonConstraint._check",
    ("seqstate/backends/vllm/serve.py", "_interrupt", "KeyboardInterrupt"):
        "the SIGTERM handler of `python -m seqstate.vllm serve`: a clean shutdown, not an error",
    ("seqstate/generation/streaming.py", "AsyncStream.__anext__", "StopAsyncIteration"):
        "the async iterator protocol: the stream has ended",
    ("seqstate/generation/streaming.py", "Stream.__next__", "StopIteration"):
        "the iterator protocol: the stream has ended (its value is the final state)",
    ("seqstate/persist.py", "decode_rows", "ValueError"):
        "caught in decode_rows itself: a damaged saved state becomes StateFormatError",
    ("seqstate/models/__init__.py", "__getattr__", "AttributeError"):
        "a module's __getattr__ protocol (PEP 562): a name the package does not have",
}


def _verify_rule(where: str, name: str, sole: bool) -> bool:
    """A ``RuntimeError`` of ``verify()`` or a helper of it (``_verify*``): store corruption,
    a seqstate bug that the stores' own tests look for; no input leads there."""
    return name == "RuntimeError" and any(
        part == "verify" or part.startswith("_verify") for part in where.split("."))


def _abstract_rule(where: str, name: str, sole: bool) -> bool:
    """A ``NotImplementedError`` that is a method's whole body: an abstract method, which
    every concrete class overrides."""
    return name == "NotImplementedError" and sole


RULES = (_verify_rule, _abstract_rule)


class _Raise(NamedTuple):
    where: str          # the enclosing function's qualname ("<module>" at top level)
    name: str           # the built-in exception class raised
    line: int
    sole: bool          # the raise is its function's whole body (a docstring aside)


def _raises(path: pathlib.Path) -> list[_Raise]:
    """Each ``raise`` of a bare built-in exception class in ``path``."""
    found: list[_Raise] = []

    def body_is(function: ast.AST | None, node: ast.Raise) -> bool:
        body = getattr(function, "body", [])
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]                                     # the docstring
        return body == [node]

    def walk(node: ast.AST, scope: tuple[str, ...], function: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, scope + (child.name,), child)
                continue
            if isinstance(child, ast.ClassDef):
                walk(child, scope + (child.name,), None)
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                    found.append(_Raise(".".join(scope) or "<module>", exc.id, child.lineno,
                                        body_is(function, child)))
            walk(child, scope, function)

    walk(ast.parse(path.read_text(encoding="utf-8"), str(path)), (), None)
    return found


def test_every_raise_in_the_package_is_typed_or_documented():
    seen, bare = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for r in _raises(path):
            keys = {k for k in INTERNAL
                    if k[0] == rel and k[2] == r.name and fnmatch.fnmatchcase(r.where, k[1])}
            seen |= keys
            if not keys and not any(rule(r.where, r.name, r.sole) for rule in RULES):
                bare.append(f"{rel}:{r.line} {r.where} raises {r.name}")
    assert not bare, (
        "bare built-in raises: raise a seqstate.errors class (it subclasses the built-in "
        "too), or, if no user input can reach it, add it to INTERNAL with the reason:\n"
        + "\n".join(bare))
    stale = sorted(set(INTERNAL) - seen)
    assert not stale, f"entries that match no raise any more (remove them): {stale}"


def test_the_walk_finds_bare_raises_and_the_rules_read_them(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "class A:\n"
        "    def f(self):\n"
        "        def g():\n"
        "            raise ValueError('x') from None\n"
        "        raise KeyError\n"
        "    def abstract(self):\n"
        "        \"\"\"Doc.\"\"\"\n"
        "        raise NotImplementedError\n"
        "    def _verify_links(self):\n"
        "        if self:\n"
        "            raise RuntimeError('corrupt')\n"
        "def h(e):\n"
        "    raise ss.ArgumentError('typed')\n"
        "    raise e\n"
        "    raise\n")
    found = _raises(source)
    assert [(r.where, r.name, r.line) for r in found] == [
        ("A.f.g", "ValueError", 4), ("A.f", "KeyError", 5),
        ("A.abstract", "NotImplementedError", 8), ("A._verify_links", "RuntimeError", 11)]
    assert [any(rule(r.where, r.name, r.sole) for rule in RULES) for r in found] == [
        False, False, True, True]


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_is_public_and_subclasses_a_builtin(name):
    cls = getattr(errors, name)
    assert getattr(ss, name) is cls and name in ss.__all__
    if cls is not errors.SeqStateError:
        assert issubclass(cls, errors.SeqStateError)
        assert any(b.__module__ == "builtins" and b is not Exception for b in cls.__mro__[1:])


# -- each case raises its typed error, still the built-in it was --------------------------------
def test_a_prompt_of_the_wrong_type(tiny):
    for prompt in (3, [], ["a", 1], [[1, 2]]):
        with pytest.raises(ss.ArgumentError, match="a prompt is a str") as err:
            ss.text(tiny)(prompt, max_tokens=1)
        assert isinstance(err.value, TypeError) and "ss.from_tokens" in str(err.value)


def test_a_choice_method_that_does_not_exist(tiny):
    with pytest.raises(ss.ArgumentError, match="'generate'.*'score'.*got 'vote'") as err:
        ss.choice(tiny, ["yes", "no"], method="vote")
    assert isinstance(err.value, ValueError)


def test_hooks_with_beam_search_are_refused_before_compute(tiny):
    before = tiny.stats
    with pytest.raises(ss.ArgumentError, match="not beam search") as err:
        ss.text(tiny)("Hi", max_tokens=2, sampler=ss.beam_search(2),
                      hooks=[ss.hooks.ban_phrases(["e"])])
    assert isinstance(err.value, ValueError) and tiny.stats == before


def test_resume_of_a_scored_choice(tiny):
    pick = ss.choice(tiny, ["yes", "no"], method="score")
    s = pick("Q: yes or no?\nA:")
    with pytest.raises(ss.ArgumentError, match="nothing to resume") as err:
        pick.resume(s)
    assert isinstance(err.value, ValueError)


def test_token_healing_on_resume(tiny):
    gen = ss.text(tiny)
    s = gen("Once upon", max_tokens=2)
    with pytest.raises(ss.ArgumentError, match="token_healing") as err:
        gen.resume(s, token_healing=True)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("token_ids", [[], [1, 2, 3], [[1.5]], None])
def test_from_tokens_needs_lists_of_int_ids(tiny, token_ids):
    with pytest.raises(ss.ArgumentError, match="one list of int token ids per batch item") as err:
        ss.from_tokens(tiny, token_ids)
    assert isinstance(err.value, ValueError)


def test_from_tokens_takes_integer_arrays(tiny):
    assert ss.from_tokens(tiny, torch.tensor([[1, 2, 3]])).token_ids == [[[1, 2, 3]]]
    with pytest.raises(ss.ArgumentError, match="outside the vocabulary"):
        ss.from_tokens(tiny, [[tiny.vocab.size]])


def test_a_capture_name_not_found(tiny):
    s = ss.text(tiny)("Name:", max_tokens=2, name="who")
    with pytest.raises(ss.CaptureNotFound) as err:
        s["what"]
    assert isinstance(err.value, KeyError)
    # the message reads as a sentence (KeyError's own str() would quote it)
    assert str(err.value).startswith("no call named 'what' in this state; named calls: ['who']")
    assert "what" not in s.captures and s.captures.get("what") is None


def test_what_continuous_cannot_wrap(tiny):
    with pytest.raises(ss.ArgumentError, match="outlines steerable Generator") as err:
        ss.continuous(object())
    assert isinstance(err.value, TypeError)
    with pytest.raises(ss.ArgumentError, match="got object; use continuous") as err:
        _from_processor(object(), tiny)
    assert isinstance(err.value, TypeError)


def test_a_custom_steps_logits_of_the_wrong_shape(tiny):
    st = Stepper(tiny, [tiny.encode("x")])
    for bad in (torch.zeros(2, tiny.vocab.size), torch.zeros(tiny.vocab.size),
                [[0.0] * tiny.vocab.size]):
        with pytest.raises(ss.LogitsError, match="expected logits for 1 live rows") as err:
            st.step(bad)
        assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_nan_logits_name_the_likely_overflow(tiny, dtype):
    st = Stepper(tiny, [tiny.encode("x")])
    with pytest.raises(ss.LogitsError, match="float16/bfloat16") as err:
        st.step(torch.full((1, tiny.vocab.size), float("nan"), dtype=dtype))
    assert isinstance(err.value, ValueError) and "dtype=torch.float32" in str(err.value)


def test_from_outlines_of_something_else():
    with pytest.raises(ss.ArgumentError, match="from_hf"):
        ss.models.from_outlines(object())


def test_a_cache_full_error_is_public_and_a_context_overflow():
    assert issubclass(ss.CacheFullError, ss.ContextOverflowError)
    from seqstate.backends.base import CacheFullError
    assert CacheFullError is ss.CacheFullError


@pytest.mark.llamacpp
def test_a_failed_llama_decode_says_what_its_status_means():
    from conftest import request_llamacpp

    request_llamacpp()
    from seqstate.backends.llamacpp.backend import LlamaCppBackend
    from seqstate.backends.llamacpp.native import SCRATCH_SEQ

    backend = LlamaCppBackend(ss.models.default_gguf(), n_ctx=256, n_threads=1)
    bad = backend.vocab_size + 5                  # a token id outside the vocabulary: -1
    with pytest.raises(ss.EngineError, match="status -1: an invalid batch"):
        backend._decode([bad], [0], [SCRATCH_SEQ], [True])
    backend.llama.free_top(SCRATCH_SEQ)
    backend.verify()


# -- messages that name the problem -------------------------------------------------------------
def test_a_regex_that_matches_nothing_says_so(tiny):
    with pytest.raises(ss.ConstraintError, match="matches no text at all") as err:
        ss.regex(tiny, r"[^\s\S]")
    assert "encoding" not in str(err.value) and "[^\\s\\S]" in str(err.value)


@pytest.mark.parametrize("pattern, position, reason", [
    ("(ab", 0, "missing \\), unterminated subpattern"),
    ("ab{3,1}", 3, "min repeat greater than max repeat"),
    ("[z-a]x", 1, "bad character range z-a"),
])
def test_a_regex_syntax_error_names_its_position(tiny, pattern, position, reason):
    with pytest.raises(ss.ConstraintError, match=f"syntax error at position {position}: {reason}"
                       ) as err:
        ss.regex(tiny, pattern)
    caret = str(err.value).splitlines()[-1]
    assert caret.index("^") - 4 == position and "DFA" not in str(err.value)


@pytest.mark.parametrize("pattern, position, construct, instead", [
    (r"\d+(?=px)", 3, "the lookahead `(?=...)`", r"write `\d+px`"),
    (r"(?<!-)\d+", 0, "the negative lookbehind `(?<!...)`", "ss.hooks"),
    (r"(a|b)x\1", 6, r"the backreference `\1`", "repeat the group's pattern"),
    (r"[(?=]\bcat", 5, r"the word boundary `\b`", "[^A-Za-z0-9_]"),
    (r"\(?=(?>ab)", 4, "the atomic group `(?>...)`", "ordinary group"),
])
def test_an_unsupported_construct_says_which_and_what_instead(tiny, pattern, position,
                                                              construct, instead):
    with pytest.raises(ss.ConstraintError, match=re.escape(f"uses {construct} at position "
                                                           f"{position}")) as err:
        ss.regex(tiny, pattern)
    assert instead in str(err.value) and "DFA" not in str(err.value)
    assert str(err.value).splitlines()[-1].index("^") - 4 == position


def test_a_model_mismatch_tells_two_loads_of_one_model_apart(tiny):
    other = ss.models.testing.tiny()
    assert repr(other) == repr(tiny)
    s = ss.text(tiny)("Hi", max_tokens=1)
    with pytest.raises(ss.ModelMismatch) as err:
        ss.text(other)(s, max_tokens=1)
    message = str(err.value)
    assert hex(id(tiny)) in message and hex(id(other)) in message
    assert "two loads of one model do not share states" in message
    with pytest.raises(ss.ModelMismatch, match="only states of one model object concatenate"):
        s + ss.text(other)("Hi", max_tokens=1)


def test_a_greedy_warning_does_not_precede_the_error_it_leads_to(tiny):
    three = ss.text(tiny)("Hi", max_tokens=1, num_samples=3, sampler=ss.multinomial(), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # a warning would be raised before the error
        with pytest.raises(ss.SampleMismatch):
            ss.text(tiny)(three, max_tokens=1, num_samples=2)
        with pytest.raises(ss.SampleMismatch):
            ss.choice(tiny, ["a", "b"], method="score")(three, num_samples=2)
    with pytest.warns(UserWarning, match="identical copies"):   # a valid call still warns
        ss.text(tiny)("Hi", max_tokens=1, num_samples=2)


# -- what a new user trips on (issue 61) ---------------------------------------------------------
@pytest.mark.parametrize("build", [ss.text, lambda m: ss.json(m, {"type": "integer"}),
                                   lambda m: ss.regex(m, "a+"), lambda m: ss.choice(m, ["a"]),
                                   lambda m: ss.cfg(m, 'start: "a"'), ss.chat])
def test_a_models_name_given_as_the_model(build):
    with pytest.raises(ss.ArgumentError, match=r"takes a seqstate model .*got str "
                                               r"'HuggingFaceTB/SmolLM2-135M'.*load it first"):
        build("HuggingFaceTB/SmolLM2-135M")


def test_a_lone_surrogate_in_a_prompt(tiny):
    broken = "Caf\udce9 au lait"            # read with errors="surrogateescape"
    for attempt in (lambda: ss.text(tiny)(broken, max_tokens=2),
                    lambda: ss.text(tiny)("Once", max_tokens=2) + broken):
        with pytest.raises(ss.ArgumentError, match=r"lone surrogate '\\udce9' at character 3"):
            attempt()
    assert ss.text(tiny)("Caf\u00e9", max_tokens=2).shape == (1, 1)    # the model is usable


def test_a_misspelt_grammar_name():
    with pytest.raises(ss.ArgumentError, match=r"'jsonn'; did you mean 'json'\? shipped "
                                               r"grammars: arithmetic, .*json"):
        ss.grammars.load("jsonn")
    with pytest.raises(KeyError):               # as before
        ss.grammars.load("jsonn")


def test_resume_of_another_kind_of_call_is_refused(tiny):
    words = ss.text(tiny)("Say:", max_tokens=3)
    with pytest.raises(ss.ArgumentError, match=r"a text call, but this is a regex generator"):
        ss.regex(tiny, "[0-9]+").resume(words, max_tokens=3)
    digits = ss.regex(tiny, "[0-9]+")("N: ", max_tokens=2)
    with pytest.raises(ss.ArgumentError, match=r"a regex call, but this is a text generator"):
        ss.text(tiny).resume(digits, max_tokens=3)
    # the same kind resumes, and calling on the state starts a new call after it
    assert ss.regex(tiny, "[0-9]+").resume(digits, max_tokens=3).shape == (1, 1)
    assert ss.regex(tiny, "[0-9]+")(words, max_tokens=3).shape == (1, 1)
