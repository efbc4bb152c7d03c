"""SequenceState algebra: Hypothesis laws, broadcasting, errors, immutability."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import seqstate as ss

SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
words = st.text(alphabet="abcdefgh xyz,.", min_size=1, max_size=20)


@SETTINGS
@given(words, words)
def test_concat_token_prefix_is_left(tiny, a_text, b_text):
    a = ss.from_tokens(tiny, [tiny.encode(a_text)])
    b = ss.from_tokens(tiny, [tiny.encode(b_text)])
    n = len(a.token_ids[0][0])
    assert (a + b)[..., :n] == a
    assert (a + b_text)[..., :n] == a


@SETTINGS
@given(words, st.integers(1, 5))
def test_prefix_slice_then_continue_equals_fresh_prompt(tiny, text, k):
    gen = ss.text(tiny)
    s = gen(text, max_tokens=6)
    ids = s.token_ids[0][0]
    cut = max(1, len(ids) - k)
    continued = gen(s[..., :cut], max_tokens=4)
    fresh = gen(ss.from_tokens(tiny, [ids[:cut]]), max_tokens=4)
    assert continued == fresh


@SETTINGS
@given(words, st.integers(2, 4))
def test_forking_leaves_parent_unchanged(tiny, text, k):
    parent = ss.text(tiny)(text, max_tokens=3)
    snapshot = (parent.token_ids, parent.logprobs, parent.shape)
    kids = ss.text(tiny)(parent, num_samples=k, sampler=ss.multinomial(), seed=1, max_tokens=3)
    assert kids.shape == (1, k)
    assert (parent.token_ids, parent.logprobs, parent.shape) == snapshot
    assert all(kids.token_ids[0][i][: len(snapshot[0][0][0])] == snapshot[0][0][0] for i in range(k))


def test_list_is_batch_major(tiny):
    s = ss.text(tiny)(["a", "b"], num_samples=3, sampler=ss.multinomial(), seed=0, max_tokens=2)
    assert list(s) == [s.texts[b][i] for b in range(2) for i in range(3)]
    assert s.shape == (2, 3) and s.weights.shape == (2, 3)


def test_state_is_frozen(tiny):
    s = ss.from_tokens(tiny, [[1, 2, 3]])
    for field in ("rows", "n_batch", "model"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(s, field, None)


def test_weights_kept_on_text_and_summed_on_state(tiny):
    gen = ss.text(tiny)
    a = gen("x", max_tokens=3)
    b = gen("y", max_tokens=3)
    assert torch.equal((a + " more").weights, a.weights)
    # float64 sums of the same floats grouped differently (~1e-16): strict on any CPU
    assert torch.allclose((a + b).weights, a.weights + b.weights)


def test_broadcasting_and_mismatch(tiny):
    gen = ss.text(tiny)
    one = ss.from_tokens(tiny, [tiny.encode("p")])
    wide = gen(["a", "b", "c"], max_tokens=1)
    assert (one + wide).shape == (3, 1)
    assert (wide + one).shape == (3, 1)
    two = gen(["a", "b"], max_tokens=1)
    with pytest.raises(ss.BatchMismatch, match="batch sizes 3 and 2"):
        wide + two
    with pytest.raises(ss.BatchMismatch, match="give 3"):
        wide + ["x", "y"]
    per_item = wide + ["x", "y", "z"]
    assert [t[0][-1] for t in per_item.texts] == ["x", "y", "z"]


def test_str_plus_state_is_a_new_prompt(tiny):
    s = ss.text(tiny)("abc", max_tokens=2)
    t = "prefix " + s
    assert str(t) == "prefix " + str(s)
    assert t.rows[0].handle is None


def test_chars_cut_keeps_whole_tokens_and_reencodes(tiny):
    s = ss.from_tokens(tiny, [tiny.encode("Hello wonderful world")])
    cut = s.chars[:9]
    assert str(cut) == "Hello won"
    assert cut.token_ids[0][0][:1] == s.token_ids[0][0][:1]


def test_strict_slice_and_non_prefix_slices(tiny):
    s = ss.text(tiny)("some words here", max_tokens=4)
    assert s.slice((..., slice(None, 3)), strict=True).rows[0].handle is not None
    with pytest.raises(ss.SlicingError, match="not a prefix"):
        s.slice((..., slice(1, 3)), strict=True)
    assert s[..., 1:3].rows[0].handle is None
    assert len(s[-1].token_ids[0][0]) == 1


def test_model_mismatch(tiny, fresh_tiny):
    s = ss.from_tokens(tiny, [[5, 6]])
    with pytest.raises(ss.ModelMismatch):
        ss.text(fresh_tiny)(s)
    with pytest.raises(ss.ModelMismatch):
        s + ss.from_tokens(fresh_tiny, [[5]])


def test_sample_mismatch(tiny):
    s = ss.text(tiny)("a", num_samples=3, sampler=ss.multinomial(), seed=0, max_tokens=1)
    assert ss.text(tiny)(s, max_tokens=1).shape == (1, 3)
    assert ss.text(tiny)(s, num_samples=3, max_tokens=1).shape == (1, 3)
    with pytest.raises(ss.SampleMismatch, match="3 samples"):
        ss.text(tiny)(s, num_samples=2)


def test_repr_and_html(tiny):
    s = ss.text(tiny)(["a", "b"], max_tokens=2)
    assert "shape=(2, 1)" in repr(s) and "[1,0]" in repr(s)
    assert s._repr_html_().count("<div>") == 2
