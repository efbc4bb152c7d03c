"""The step API reproduces the engine's output when fed the same logits."""

import pytest
import torch

import seqstate as ss
from seqstate.detokenize import StopMatcher
from seqstate.engine import RowRequest, Stepper, generate


def drive(model, stepper):
    while not stepper.done:
        logits = torch.stack([model.full_logits(stepper.tokens(i))[-1] for i in stepper.live])
        stepper.step(logits)
    return stepper.results()


def test_stepper_reproduces_engine(tiny):
    c = ss.constraints.regex(tiny, r"[a-z ]{3,12}\.")
    reqs = [RowRequest(tuple(tiny.encode("Say:")), 16, c.start()),
            RowRequest(tuple(tiny.encode("Other")), 10, None, StopMatcher(["e"]))]
    ours = generate(tiny, reqs, ss.greedy())
    theirs = drive(tiny, Stepper(tiny, reqs))
    for a, b in zip(ours, theirs):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason and a.text == b.text


def test_stepper_with_hooks_and_sampling(tiny):
    reqs = [RowRequest(tuple(tiny.encode("A")), 8)]
    hook = ss.hooks.ban_phrases(["e"])
    ours = generate(tiny, reqs, ss.multinomial(), torch.Generator().manual_seed(3), [hook])
    theirs = drive(tiny, Stepper(tiny, reqs, ss.multinomial(), torch.Generator().manual_seed(3), [hook]))
    assert ours[0].tokens == theirs[0].tokens


def test_stepper_rejects_bad_logits(tiny):
    st = Stepper(tiny, [tiny.encode("x")])
    with pytest.raises(ValueError, match="NaN"):
        st.step(torch.full((1, tiny.vocab.size), float("nan")))
    with pytest.raises(ValueError, match="1 live rows"):
        st.step(torch.zeros(2, tiny.vocab.size))
