"""Streaming: UTF-8-safe chunks, stop-string hold-back, chunks concatenate to the final text."""

import pytest

import seqstate as ss
from conftest import collect


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
