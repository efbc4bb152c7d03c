"""Engine capabilities are enforced: a feature that needs one the engine lacks is refused
before any compute, with a `CapabilityError` naming the capability and the engine."""

import dataclasses
import pickle

import pytest

import seqstate as ss


class _Limited:
    """The tiny model's backend, declaring less than it can do."""

    def __init__(self, inner, **missing: bool) -> None:
        self._inner = inner
        self.capabilities = dataclasses.replace(inner.capabilities, name="limited", **missing)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def model():
    return ss.models.testing.tiny(seed=3)


@pytest.fixture
def limited(model, request, monkeypatch):
    """``model`` on a backend without the capability the test is parametrized with."""
    monkeypatch.setattr(model, "backend", _Limited(model.backend, **{request.param: False}))
    return model


def _refused(model, capability: str, call) -> None:
    before = model.stats
    with pytest.raises(ss.CapabilityError) as info:
        call()
    assert info.value.capability == capability and info.value.engine == "limited"
    assert capability in str(info.value) and "'limited' engine" in str(info.value)
    assert model.stats == before                     # refused before any compute


# what each capability's absence refuses, and what still runs without it
REFUSED = {
    "full_logits": {
        "model.full_logits()": lambda m: m.full_logits(m.encode("Hi")),
    },
    "prefix_sharing": {
        "forking": lambda m: ss.text(m)("Hi", max_tokens=3, num_samples=2,
                                        sampler=ss.multinomial(), seed=0),
        "forking a scored choice": lambda m: ss.choice(m, ["a", "b"], method="score")(
            "Hi", num_samples=2, sampler=ss.multinomial()),
        "beam search": lambda m: ss.text(m)("Hi", max_tokens=3, sampler=ss.beam_search(1)),
    },
    "batching": {
        "several prompts": lambda m: ss.text(m)(["Hi", "Yo"], max_tokens=3),
        "several samples": lambda m: ss.choice(m, ["a", "b"])("Hi", num_samples=2,
                                                               sampler=ss.multinomial()),
        "a state of several rows": lambda m: ss.text(m)(ss.from_tokens(m, [[1, 2], [3, 4]]),
                                                        max_tokens=2),
        "beam search of width 2": lambda m: ss.text(m)("Hi", max_tokens=3,
                                                       sampler=ss.beam_search(2)),
    },
}

STILL_RUN = {
    "full_logits": {
        "text": lambda m: ss.text(m)("Hi", max_tokens=3),
        "a constraint, sampled": lambda m: ss.regex(m, "[0-9]{2}")(
            ["a", "b"], num_samples=2, sampler=ss.multinomial(repetition_penalty=1.2), seed=1),
        "token healing": lambda m: ss.json(m, {"type": "integer"})("x = 1", max_tokens=4,
                                                                  token_healing=True),
        "option scoring": lambda m: ss.choice(m, ["yes", "no"], method="score")("Hi"),
        "streaming": lambda m: ss.final_state(ss.text(m).stream("Hi", max_tokens=3)),
    },
    "prefix_sharing": {
        "several prompts": lambda m: ss.text(m)(["Hi", "Yo"], max_tokens=3),
        "hooks": lambda m: ss.text(m)("Hi", max_tokens=3, hooks=[lambda e: None]),
        "continuing a state": lambda m: ss.text(m)(ss.text(m)("Hi", max_tokens=2) + " and",
                                                   max_tokens=2),
    },
    "batching": {
        "one row": lambda m: ss.cfg(m, 'start: "x" | "y"')("Hi"),
        "hooks": lambda m: ss.text(m)("Hi", max_tokens=3, hooks=[lambda e: None]),
        "option scoring over options": lambda m: ss.choice(m, ["a", "b", "c"],
                                                           method="score")("Hi"),
        "beam search of width 1": lambda m: ss.text(m)("Hi", max_tokens=3,
                                                       sampler=ss.beam_search(1)),
    },
}


@pytest.mark.parametrize("limited, feature", [
    (cap, feature) for cap, features in REFUSED.items() for feature in features],
    indirect=["limited"])
def test_a_feature_is_refused_without_its_capability(limited, feature):
    capability = limited.backend.capabilities
    missing = next(name for name in REFUSED if not getattr(capability, name))
    _refused(limited, missing, lambda: REFUSED[missing][feature](limited))


@pytest.mark.parametrize("limited, feature", [
    (cap, feature) for cap, features in STILL_RUN.items() for feature in features],
    indirect=["limited"])
def test_features_that_do_not_need_a_capability_still_run(limited, feature):
    capability = limited.backend.capabilities
    missing = next(name for name in STILL_RUN if not getattr(capability, name))
    state = STILL_RUN[missing][feature](limited)
    assert isinstance(state, ss.SequenceState) and all(state.texts)


@pytest.mark.parametrize("limited", ["full_logits"], indirect=True)
def test_the_error_says_what_to_do(limited):
    with pytest.raises(ss.CapabilityError,
                       match=r"is needed for model\.full_logits\(\).*use the hf") as info:
        limited.full_logits(limited.encode("Hi"))
    assert "full_logits" in str(info.value) and repr(limited.name) in str(info.value)


def test_capability_error_is_typed_and_travels():
    error = ss.CapabilityError("beam search needs 'full_logits'", "full_logits", "vllm")
    assert isinstance(error, ss.SeqStateError) and isinstance(error, NotImplementedError)
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.capability, again.engine) == (str(error), "full_logits", "vllm")
    assert "CapabilityError" in ss.__all__


def test_the_engines_of_today_have_every_capability(model):
    caps = model.backend.capabilities
    assert caps.full_logits and caps.prefix_sharing and caps.batching
