"""Key normalisation: the shortcut rules, ellipsis, and clear errors."""

import pytest

import seqstate as ss
from seqstate.errors import SlicingError
from seqstate.indexing import is_prefix, normalize, token_positions


def test_full_key_always_accepted():
    sel = normalize((1, slice(0, 2), slice(None, -5)), (3, 3))
    assert sel.batch == (1,) and sel.samples == (0, 1) and sel.token == slice(None, -5)


@pytest.mark.parametrize("shape,key,expected", [
    ((1, 1), 3, ((0,), (0,), 3)),
    ((1, 4), (2, slice(0, 5)), ((0,), (2,), slice(0, 5))),
    ((4, 1), (2, slice(0, 5)), ((2,), (0,), slice(0, 5))),
    ((3, 3), slice(0, 2), ((0, 1), (0, 1, 2), slice(None))),
    ((3, 3), (slice(0, 2), slice(1, 3)), ((0, 1), (1, 2), slice(None))),
    ((3, 3), (Ellipsis, slice(None, -5)), ((0, 1, 2), (0, 1, 2), slice(None, -5))),
    ((3, 3), (0, Ellipsis), ((0,), (0, 1, 2), slice(None))),
    ((3, 3), (slice(None, None, -1), -1), ((2, 1, 0), (2,), slice(None))),
])
def test_shortcuts(shape, key, expected):
    sel = normalize(key, shape)
    assert (sel.batch, sel.samples, sel.token) == expected


@pytest.mark.parametrize("shape,key", [
    ((1, 1), (0, 1)),            # two parts but only the token axis remains
    ((3, 3), (0, 0, 0, 0)),
    ((3, 3), 5),
    ((3, 3), (-4,)),
    ((3, 3), "a"),
    ((3, 3), 1.5),
    ((3, 3), (Ellipsis, Ellipsis)),
    ((3, 3), (slice(5, 9),)),     # selects no batch items
    ((3, 3), (0, 0, "x")),
])
def test_bad_keys_raise_slicing_error_with_forms(shape, key):
    with pytest.raises(SlicingError, match=r"\(3, 3\)|state\[|token|selects no|out of range"):
        normalize(key, shape)


def test_slicing_error_is_index_error():
    with pytest.raises(IndexError):
        normalize(7, (2, 2))


def test_token_positions_and_prefix():
    assert list(token_positions(-1, 5, (1, 1))) == [4]
    assert list(token_positions(slice(None, -2), 5, (1, 1))) == [0, 1, 2]
    assert is_prefix(slice(None, 3)) and is_prefix(slice(0, None, 1))
    assert not is_prefix(slice(1, 3)) and not is_prefix(slice(None, None, 2)) and not is_prefix(2)
    with pytest.raises(SlicingError, match="out of range for a row of 5"):
        token_positions(5, 5, (1, 1))


# -- named-axis accessors on states ----------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (3, 1), (2, 3)])
def test_accessors_mean_the_same_on_every_shape(tiny, shape):
    b, k = shape
    base = ss.from_tokens(tiny, [[1, 2, 3, 4, 5, 6][: 3 + i] for i in range(b)])
    s = ss.text(tiny)(base, num_samples=k, max_tokens=2, sampler=ss.multinomial(), seed=0) \
        if k > 1 else base
    assert s.shape == shape and s.batch == b and s.samples == k
    assert s.tokens[:-3] == s[:, :, :-3] and s.tokens[1] == s[:, :, 1]
    assert s.samples[-1:] == s[:, -1:, :] and s.batch[0] == s[0, :, :]
    assert s.batch[0].shape == (1, k) and s.samples[0].shape == (b, 1)
    if shape == (1, 4):
        # the shortcut rule's trap: on 1xS a single key indexes samples, not tokens
        assert s[:-3].shape == (1, 1) and s.tokens[:-3].shape == (1, 4)
    with pytest.raises(ss.SlicingError):
        s.tokens.slice(slice(1, None), strict=True)
    assert repr(s.batch) == str(b) and f"{s.samples}" == str(k)
