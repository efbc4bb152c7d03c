"""Saved states (seqstate/persist.py, seqstate/restore.py): ``state.dumps()`` and
``ss.loads(model, data)`` carry everything a state is, run no code, and the loaded state
continues exactly as the original."""

import base64
import json
import pickle
import random
import re

import numpy as np

import pydantic
import pytest

import seqstate as ss
from seqstate.persist import SavedState


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=4)      # bounded: a small model finishes it
    legs: int = pydantic.Field(ge=0, le=9)


PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                        "legs": {"type": "integer", "minimum": 0,
                                                 "maximum": 9}},
       "required": ["name", "legs"], "additionalProperties": False}


def _same(a, b):
    assert a.shape == b.shape and a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs
    for ra, rb in zip(a.rows, b.rows):
        assert [(s.start, s.end, s.finish_reason, s.value, s.scores, s.name, s.text)
                for s in ra.spans] == [(s.start, s.end, s.finish_reason, s.value, s.scores,
                                        s.name, s.text) for s in rb.spans]
        assert (ra.chat is None) == (rb.chat is None)
        if ra.chat is not None:
            assert (ra.chat.messages, ra.chat.ends, ra.chat.open_at, ra.chat.answered) == \
                (rb.chat.messages, rb.chat.ends, rb.chat.open_at, rb.chat.answered)


def test_round_trip_keeps_tokens_logprobs_spans_captures_values(tiny):
    s = ss.text(tiny)(["A fox", "A cat"], max_tokens=4, num_samples=2,
                      sampler=ss.multinomial(), seed=0, name="opening")
    s = ss.choice(tiny, ["yes", "no"], method="score")(s + " ok? ", name="ok")
    s = ss.json(tiny, PET)(s + "\nJSON: ", max_tokens=40, name="pet")
    back = ss.loads(tiny, s.dumps())
    _same(back, s)
    assert back["opening"] == s["opening"] and back["ok"] == s["ok"]
    assert back.finish_reason == s.finish_reason and back.scores == s.scores
    assert back.value == s.value and back.generated == s.generated


def test_pydantic_values_are_json_unless_their_class_is_given(tiny):
    s = ss.json(tiny, Pet)("Pet: ", max_tokens=60)
    assert isinstance(s.value, Pet), s.generated
    assert ss.loads(tiny, s.dumps()).value == s.value.model_dump(mode="json")
    typed = ss.loads(tiny, s.dumps(), types=[Pet]).value
    assert isinstance(typed, Pet) and typed == s.value


def test_a_class_saved_from_a_script_matches_the_class_imported_from_it(tiny):
    """A script's classes are ``__main__``'s when it saves; a program that imports the
    script loads them by qualified name.  Given classes that match nothing are refused."""
    fields = {name: (f.annotation, f) for name, f in Pet.model_fields.items()}
    script_pet = pydantic.create_model("Pet", __module__="__main__", **fields)
    s = ss.json(tiny, script_pet)("Pet: ", max_tokens=60)
    assert isinstance(s.value, script_pet), s.generated
    typed = ss.loads(tiny, s.dumps(), types=[Pet]).value
    assert type(typed) is Pet and typed.model_dump() == s.value.model_dump()

    class Dog(pydantic.BaseModel):
        name: str

    with pytest.raises(ss.StateFormatError, match=r"__main__:Pet.*test_persist:.*Dog "
                                                  r"did not match"):
        ss.loads(tiny, s.dumps(), types=[Dog])
    assert ss.loads(tiny, s.dumps(), types=[Dog, Pet]).value == typed


def test_conversations_continue_after_loading(tiny):
    s = ss.chat(tiny).system("Be brief.").user("Name a fruit.")
    s = s.assistant(ss.text(tiny), max_tokens=5, name="fruit")
    back = ss.loads(tiny, s.dumps())
    _same(back, s)
    assert back.user("And a colour?").token_ids == s.user("And a colour?").token_ids


def test_a_loaded_state_continues_exactly(tiny):
    s = ss.text(tiny)("Once upon a time", max_tokens=6)
    back = ss.loads(tiny, s.dumps())
    text = ss.text(tiny)
    assert text(back + " then", max_tokens=8).token_ids == text(s + " then", max_tokens=8).token_ids
    assert text.resume(back, max_tokens=5).token_ids == text.resume(s, max_tokens=5).token_ids


@pytest.mark.parametrize("spec", [r"[a-z]{4} [0-9]{3}", "json"])
def test_resume_recreates_the_constraint_by_replay(tiny, spec):
    gen = ss.json(tiny, PET) if spec == "json" else ss.regex(tiny, spec)
    cut = gen("Answer: ", max_tokens=3)                 # stopped inside the constraint
    assert cut.value is None and cut.finish_reason == "max_tokens"
    back = ss.loads(tiny, cut.dumps())
    assert back.rows[0].cursors[-1] is None              # no cursor is saved
    original = gen.resume(cut, max_tokens=60)
    resumed = gen.resume(back, max_tokens=60)
    assert resumed.token_ids == original.token_ids and resumed.value == original.value
    assert resumed.finish_reason == original.finish_reason
    if spec != "json":                                   # a regex this short completes
        assert resumed.finish_reason == "constraint_complete"
    # and so does a loaded state sliced back inside the call
    sliced = ss.loads(tiny, cut[..., :-1].dumps())
    assert gen.resume(sliced, max_tokens=60).token_ids == \
        gen.resume(cut[..., :-1], max_tokens=60).token_ids


def test_resume_with_another_constraint_is_refused(tiny):
    cut = ss.regex(tiny, r"[a-z]{5}")("Word: ", max_tokens=2)
    with pytest.raises(ss.ConstraintError, match="saved call's tokens"):
        ss.regex(tiny, r"[0-9]{5}").resume(ss.loads(tiny, cut.dumps()))


def test_kv_is_recomputed_once_and_lazily():
    first = ss.models.testing.tiny()
    s = ss.text(first)("A long enough prompt to see its prefill counted", max_tokens=4)
    other = ss.models.testing.tiny()                     # same weights, nothing stored
    before = other.stats
    back = ss.loads(other, s.dumps())
    assert other.stats.prefill_tokens == before.prefill_tokens       # lazily: not yet
    a = ss.text(other)(back + " and", max_tokens=3)
    once = other.stats.prefill_tokens - before.prefill_tokens
    assert once >= len(s.token_ids[0][0]) - 1
    b = ss.text(other)(back + " but", max_tokens=3)                 # found stored now
    assert other.stats.prefill_tokens - before.prefill_tokens - once <= 2
    assert a.token_ids == ss.text(first)(s + " and", max_tokens=3).token_ids
    assert b.token_ids == ss.text(first)(s + " but", max_tokens=3).token_ids


def test_pickle_goes_through_the_same_format(tiny):
    s = ss.text(tiny)("Pickled", max_tokens=3, name="x")
    saved = pickle.loads(pickle.dumps(s))
    assert isinstance(saved, SavedState) and saved.data == s.dumps() and saved.shape == (1, 1)
    _same(ss.loads(tiny, saved), s)


def test_another_tokenizer_is_model_mismatch(tiny, gemma):
    s = ss.text(tiny)("Hello", max_tokens=2)
    with pytest.raises(ss.ModelMismatch, match="tokenizer"):
        ss.loads(gemma, s.dumps())


def test_another_tokenizer_of_the_same_model_name_says_so(tiny):
    doc = json.loads(ss.text(tiny)("Hello", max_tokens=2).dumps())
    del doc["digest"]                   # as a state saved before the digest, edited
    other = json.dumps(dict(doc, tokenizer="0" * 32)).encode()     # a revision's tokenizer
    with pytest.raises(ss.ModelMismatch, match=rf"a model also named {re.escape(repr(tiny.name))} whose "
                                               r"tokenizer differs.*digest 000000000000 saved"):
        ss.loads(tiny, other)
    renamed = json.dumps(dict(doc, tokenizer="0" * 32, model="other")).encode()
    with pytest.raises(ss.ModelMismatch, match=r"saved under 'other', whose tokenizer is not "
                                               + re.escape(f"{tiny.name!r}'s")):
        ss.loads(tiny, renamed)


def test_a_damaged_saved_state_is_refused(tiny):
    state = ss.text(tiny)("Damage me", max_tokens=6, name="x")
    data = state.dumps()
    rng = random.Random(0)
    for at in rng.sample(range(len(data)), 60):        # single-byte flips anywhere
        flipped = bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        with pytest.raises(ss.StateFormatError):
            ss.loads(tiny, bytes(flipped))
    doc = json.loads(data)
    # a state saved before the digest still loads; one with an id past the vocabulary not
    old = dict(doc)
    del old["digest"]
    _same(ss.loads(tiny, json.dumps(old).encode()), state)
    row = dict(old["rows"][0], tokens=base64.b64encode(
        np.array([1, tiny.vocab.size + 5], dtype="<i4").tobytes()).decode(),
        logprobs=base64.b64encode(np.full(2, np.nan).tobytes()).decode(), spans=[])
    with pytest.raises(ss.StateFormatError, match="outside .* vocabulary"):
        ss.loads(tiny, json.dumps(dict(old, rows=[row])).encode())


def test_data_that_is_no_state_is_refused(tiny):
    data = ss.text(tiny)("Hello", max_tokens=2).dumps()
    doc = json.loads(data)
    with pytest.raises(ss.StateFormatError, match="version"):
        ss.loads(tiny, json.dumps(dict(doc, version=99)).encode())
    with pytest.raises(ss.StateFormatError, match="not a saved state"):
        ss.loads(tiny, b"\x80\x04 a pickle")
    with pytest.raises(ss.StateFormatError, match="damaged"):
        doc["rows"][0]["logprobs"] = base64.b64encode(b"\0" * 8).decode()
        ss.loads(tiny, json.dumps(doc).encode())
    # a class named in the data is never imported or called
    doc = json.loads(data)
    del doc["digest"]                   # as a state saved before the digest, edited
    doc["rows"][0]["spans"][0]["value"] = {"$pydantic": "os:system", "json": "echo owned"}
    assert ss.loads(tiny, json.dumps(doc).encode()).value == "echo owned"


def test_values_that_cannot_be_saved_are_refused(tiny):
    s = ss.text(tiny)("Hello", max_tokens=2)
    odd = s._with_rows([s.rows[0].__class__(*[getattr(s.rows[0], f) for f in (
        "tokens", "handle", "logprobs", "cursors")], (s.rows[0].spans[0].__class__(
            0, 1, None, "stop", object()),), None)])
    with pytest.raises(ss.StateFormatError, match="cannot save"):
        odd.dumps()


def test_generated_keeps_the_text_of_a_call_that_did_not_parse(tiny):
    s = ss.json(tiny, {"type": "object", "properties": {"note": {"type": "string"}}})(
        "Note: ", max_tokens=5)
    assert s.value is None and s.finish_reason == "max_tokens"
    assert s.generated.startswith("{") and s.generated == str(s)[len("Note: "):]
    t = ss.text(tiny)("Count: one, two", max_tokens=30, stop_at=",")
    if t.finish_reason == "stop":
        assert t.generated == t.value and "," not in t.generated
    assert ss.from_tokens(tiny, [[1, 2]]).generated is None
    assert t[..., :-1].generated == tiny.vocab.decode(t.token_ids[0][0][
        t.rows[0].last_span.start:-1])
