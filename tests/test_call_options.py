"""Call options: every generator method takes the same typed keywords with the same
defaults; stop strings, seeds, penalties and warnings behave alike on every engine; foreign
spellings name seqstate's; sampling options equal Hugging Face's processors."""

import dataclasses
import inspect
import re

import pytest
import torch

import seqstate as ss
from seqstate.call import Call

from conftest import assert_close, fresh_logprobs

# -- signatures, defaults, progress ----------------------------------------------------------------


@pytest.mark.parametrize("method", ["__call__", "stream", "resume", "acall"])
def test_call_keywords_are_in_every_signature_with_calls_defaults(tiny, method):
    fn = getattr(ss.text(tiny), method)
    params = inspect.signature(fn).parameters
    fields = {f.name: f.default for f in dataclasses.fields(Call)}
    keywords = {n: p.default for n, p in params.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == fields
    assert all(params[n].annotation for n in fields)          # typed
    for name in fields:
        assert f"{name} :" in fn.__doc__


def test_the_keyword_reference_states_the_real_defaults():
    from seqstate.call import CALL_PARAMETERS, DEFAULT_MAX_TOKENS, MAX_CONSTRAINED_TOKENS
    from seqstate.hooks import DEFAULT_MAX_BACKTRACKS

    for field in dataclasses.fields(Call):
        assert f"\n{field.name} : " in "\n" + CALL_PARAMETERS, field.name
    assert f"None: {DEFAULT_MAX_TOKENS} for free text" in CALL_PARAMETERS
    assert f"bounded by {MAX_CONSTRAINED_TOKENS} tokens" in CALL_PARAMETERS
    assert f"max_backtracks : int, default {DEFAULT_MAX_BACKTRACKS}" in CALL_PARAMETERS


def test_the_speculate_reference_says_what_holds(tiny):
    from seqstate.call import CALL_PARAMETERS

    doc = " ".join(CALL_PARAMETERS.split())
    assert "the output is the same as without it" not in doc
    assert "Greedy output is the same as with False" in doc
    assert "a seeded call with several rows may draw other samples" in doc
    gen = ss.choice(tiny, ["alpha beta gamma", "alpha delta"])
    assert gen("x").token_ids == gen("x", speculate=False).token_ids


def test_call_options_type_the_same_keywords_as_call():
    from seqstate.call import CallOptions

    typed = {k: getattr(v, "__forward_arg__", v)
             for k, v in CallOptions.__annotations__.items()}
    assert typed == {f.name: f.type for f in dataclasses.fields(Call)}


FOREIGN_KEYWORDS = [("temperature", 0.7, "ss.multinomial(temperature"),
                    ("max_new_tokens", 5, "max_tokens="), ("stop", "\n", "stop_at="),
                    ("top_p", 0.9, "ss.multinomial(top_p"),
                    ("num_return_sequences", 2, "num_samples=")]


@pytest.mark.parametrize("name,value,spelling", FOREIGN_KEYWORDS,
                         ids=[k[0] for k in FOREIGN_KEYWORDS])
def test_keywords_from_other_libraries_name_the_seqstate_spelling(engine, name, value,
                                                                  spelling):
    before = engine.stats
    with pytest.raises(ss.ArgumentError, match=re.escape(spelling)):
        ss.text(engine)("x", **{name: value})
    assert (engine.stats - before).forward_calls == 0


def test_greedy_with_seed_or_samples_warns(tiny):
    with pytest.warns(UserWarning, match="greedy"):
        ss.text(tiny)("x", max_tokens=1, seed=1)
    with pytest.warns(UserWarning, match="identical copies"):
        ss.text(tiny)("x", max_tokens=1, num_samples=2)


def test_default_max_tokens_bounds_free_text_and_constrained_calls(tiny, monkeypatch):
    import importlib
    continuous = importlib.import_module("seqstate.generation.prompts")
    eos = tuple(tiny.eos_token_ids)
    no_eos = lambda e: ss.hooks.Resample(ban=eos) if e.token in eos else None  # noqa: E731
    s = ss.text(tiny)("Go", hooks=[no_eos])
    assert len(s.rows[0].tokens) - 1 == continuous.DEFAULT_MAX_TOKENS == 256
    assert s.finish_reason == "max_tokens"
    monkeypatch.setattr(continuous, "MAX_CONSTRAINED_TOKENS", 5)
    s = ss.regex(tiny, "[a-z]*")("Go")
    assert len(s.token_ids[0][0]) - 1 <= 5 and s.finish_reason in ("max_tokens", "eos",
                                                                    "constraint_complete")


def test_progress_shows_and_can_be_silenced(tiny, capsys, monkeypatch):
    ss.text(tiny)("Go", max_tokens=5, progress=True)
    assert "tok" in capsys.readouterr().err
    ss.text(tiny)("Go", max_tokens=5, progress=False)
    ss.text(tiny)("Go", max_tokens=5)               # automatic: stderr is not a terminal here
    assert capsys.readouterr().err == ""
    ss.text(tiny)("Go", max_tokens=2, sampler=ss.beam_search(2), progress=True)
    assert "tok" in capsys.readouterr().err
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.setenv("SEQSTATE_PROGRESS", "0")
    ss.text(tiny)("Go", max_tokens=5)
    assert capsys.readouterr().err == ""
    with pytest.raises(ss.ArgumentError, match="progress"):
        ss.text(tiny)("Go", progress="yes")


# -- sampling options vs Hugging Face's processors ----------------------------------------------


def test_sampling_options_equal_hf_logits_processors():
    from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    ids = torch.randint(0, 50, (3, 12), generator=g)
    sampler = ss.multinomial(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05,
                             repetition_penalty=1.3)
    ours = sampler.warp(logits, [(row.tolist(), 12) for row in ids])
    theirs = logits.clone()
    for proc in (RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7),
                 TopKLogitsWarper(20), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)):
        theirs = proc(ids, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = torch.isfinite(ours)
    # the same elementwise ops on the same fixed tensor (no matmul, no batch): equal here; an
    # ulp at these magnitudes (< 16) is under 1e-6, so any CPU's rounding stays within
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=0, atol=1e-6)


def test_presence_and_frequency_penalties_count_this_calls_tokens():
    logits = torch.zeros(1, 6)
    sampler = ss.multinomial(presence_penalty=0.5, frequency_penalty=0.25)
    # tokens before start (the prompt) are not penalized; 2 occurs twice, 4 once
    out = sampler.warp(logits, [([1, 1, 2, 4, 2], 2)])
    assert out.tolist() == [[0.0, 0.0, -1.0, 0.0, -0.75, 0.0]]


def test_penalties_change_what_a_call_draws(engine, reference):
    # a prompt whose plain continuation repeats a token on these weights (hf: the tiny model)
    prompt = "x" if engine.engine == "hf" else "la la la la la la la la"
    start = len(engine.encode_prompt(prompt))
    plain = ss.text(engine)(prompt, max_tokens=8, sampler=ss.multinomial(temperature=0.1),
                            seed=3)
    strict = ss.text(engine)(prompt, max_tokens=8, seed=3,
                             sampler=ss.multinomial(temperature=0.1, frequency_penalty=2.0,
                                                    repetition_penalty=1.3, min_p=0.05))
    new = strict.token_ids[0][0][start:]
    # the largest frequency penalty vLLM accepts, 20 logits per repeat at this temperature
    assert len(set(new)) == len(new)
    assert len(set(plain.token_ids[0][0][start:])) < 8   # without it, this prompt repeats
    # log-probs stay the model's own, not the penalized ones
    fresh = fresh_logprobs(reference, strict.token_ids[0][0])
    for pos, (tok, lp) in enumerate(zip(new, strict.logprobs[0][0][start:]), start):
        assert_close(lp, fresh[pos - 1, tok], reference, "a sampled token's log-prob vs fresh")


@pytest.mark.parametrize("stop", ["\n", [".", ","]], ids=["newline", "either of two"])
def test_stop_at_ends_the_text_where_the_free_text_has_it(engine, stop):
    prompt = "Write a sentence about cats:"
    free = ss.text(engine)(prompt, max_tokens=24)
    stopped = ss.text(engine)(prompt, max_tokens=24, stop_at=stop)
    found = [i for i in (free.value.find(s) for s in ([stop] if isinstance(stop, str) else stop))
             if i >= 0]
    if found:
        assert stopped.value == free.value[:min(found)] and stopped.finish_reason == "stop"
        assert str(stopped).startswith(str(free)[:len(prompt) + min(found)])
    else:
        assert stopped.token_ids == free.token_ids
        assert stopped.finish_reason == free.finish_reason


def test_a_seed_reproduces_samples(engine):
    prompt = "Pick a random fruit:"
    draw = dict(num_samples=4, max_tokens=6, sampler=ss.multinomial(), seed=7)
    a, b = ss.text(engine)(prompt, **draw), ss.text(engine)(prompt, **draw)
    assert a.token_ids == b.token_ids
    assert len({tuple(r.tokens) for r in a.rows}) > 1     # samples differ from each other


def test_bad_sampling_options_are_argument_errors():
    for kw in ({"min_p": 1.5}, {"repetition_penalty": 0}, {"presence_penalty": float("inf")},
               {"frequency_penalty": "a"}):
        with pytest.raises(ss.ArgumentError):
            ss.multinomial(**kw)


@pytest.mark.parametrize("constructor", [ss.text, ss.choice, ss.regex, ss.json, ss.cfg])
def test_each_constructor_documents_its_calls_keywords_where_help_finds_them(constructor):
    import pydoc

    shown = pydoc.render_doc(constructor, renderer=pydoc.plaintext)
    for keyword in Call.parameters():
        assert f"\n    {keyword.name} : " in shown, f"help({constructor.__name__}) lacks {keyword.name}"
    assert "Other Parameters" in shown and "gen(prompt, **keywords)" in shown
