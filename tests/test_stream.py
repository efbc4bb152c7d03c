"""Streaming: UTF-8-safe chunks, stop-string hold-back, chunks concatenate to the final text."""

import codecs

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqstate as ss
from conftest import collect
from seqstate.detokenize import IncrementalDecoder


def test_multibyte_chunks_concatenate_exactly(tiny):
    gen = ss.regex(tiny, r"[éàü日本語]{8}")
    chunks, state = collect(gen.stream("Accents: "))
    assert "".join(chunks) == state.value
    assert all("\ufffd" not in c for c in chunks)


def test_multi_token_stop_string_is_held_back(tiny):
    free = ss.text(tiny)("go", max_tokens=30).value
    stop = free[6:14]
    chunks, state = collect(ss.text(tiny).stream("go", max_tokens=30, stop_at=stop))
    assert state.finish_reason == "stop"
    assert "".join(chunks) == state.value == free[: free.index(stop)]
    assert not any(stop in c for c in chunks)


def test_batched_stream_yields_tagged_chunks(tiny):
    chunks, state = collect(ss.text(tiny).stream(["a", "b"], max_tokens=4))
    for b in range(2):
        assert "".join(c for i, _, c in chunks if i == b) == state.value[b][0]


def test_final_state_helper(tiny):
    s = ss.final_state(ss.text(tiny).stream("x", max_tokens=3))
    assert s == ss.text(tiny)("x", max_tokens=3)


def test_stream_never_emits_text_a_ban_rolls_back(tiny):
    # ban two-token phrases that greedy decoding produces, so rollbacks reach back past a token
    free = ss.text(tiny)("Once upon a time", max_tokens=24)
    gen = free.token_ids[0][0][-24:]
    phrases = [tiny.vocab.decode(gen[i:i + 2]).strip() for i in range(0, 20, 5)]
    phrases = [p for p in phrases if len(p) >= 3]
    hook = ss.hooks.ban_phrases(phrases)
    chunks, state = collect(ss.text(tiny).stream("Once upon a time", max_tokens=24, hooks=[hook]))
    assert "".join(chunks) == state.value
    assert not any(p.lower() in state.value.lower() for p in phrases)


def test_stream_with_a_hook_that_gives_no_lookback_holds_everything(tiny):
    from seqstate.hooks import Rollback

    fired = []

    def late_rollback(event):
        if len(event.generated) == 6 and not fired:
            fired.append(True)
            return Rollback(5)
        return None

    chunks, state = collect(ss.text(tiny).stream("Hello", max_tokens=10, hooks=[late_rollback]))
    assert fired and "".join(chunks) == state.value


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), max_size=24))
def test_detokenizer_chunks_are_the_bytes_decoded(tiny, picks):
    """The incremental detokenizer (a whole token's own text where no character is pending)
    gives exactly what a UTF-8 incremental decoder gives for the same bytes, chunk by chunk."""
    vocab = tiny.vocab
    partial = [i for i, t in enumerate(vocab.token_text) if t is None and vocab.token_bytes[i]]
    assert partial, "the vocabulary has tokens holding part of a character"
    tokens = [partial[k % len(partial)] if broken else k % vocab.size for broken, k in picks]
    ours, reference = IncrementalDecoder(vocab), codecs.getincrementaldecoder("utf-8")("replace")
    for t in tokens:
        assert ours.push(t) == reference.decode(vocab.token_bytes[t])
        ours = ours.copy()
    assert ours.flush() == reference.decode(b"", final=True)


def test_sync_stream_object_has_its_final_state(tiny):
    stream = ss.text(tiny).stream("Stream me", max_tokens=6)
    with pytest.raises(ss.ArgumentError, match="not ended"):
        stream.state
    chunks = list(stream)
    assert stream.state == ss.text(tiny)("Stream me", max_tokens=6)
    assert "".join(chunks) == stream.state.generated
    assert ss.final_state(ss.text(tiny).stream("Stream me", max_tokens=6)) == stream.state
    chunks, state = collect(ss.text(tiny).stream("Stream me", max_tokens=6))  # StopIteration
    assert state == stream.state


def test_a_closed_streams_state_says_it_has_none(tiny):
    import asyncio

    stream = ss.text(tiny).stream("Stream me", max_tokens=60)
    next(stream)
    stream.close()
    with pytest.raises(ss.ArgumentError, match="closed .* before its end, so it has no final"):
        stream.state
    ended = ss.text(tiny).stream("Stream me", max_tokens=6)
    list(ended)
    ended.close()                                   # after its end: the state stays
    assert ended.state == ss.text(tiny)("Stream me", max_tokens=6)

    async def closed_early():
        astream = ss.text(tiny).astream("Stream me", max_tokens=60)
        await astream.__anext__()
        await astream.aclose()
        return astream

    astream = asyncio.run(closed_early())
    with pytest.raises(ss.ArgumentError, match="closed .* before its end, so it has no final"):
        astream.state
