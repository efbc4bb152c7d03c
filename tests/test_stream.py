"""Streaming: UTF-8-safe chunks, stop-string hold-back, chunks concatenate to the final text."""

import pytest

import seqstate as ss


def collect(stream):
    chunks = []
    while True:
        try:
            chunks.append(next(stream))
        except StopIteration as stop:
            return chunks, stop.value


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


def test_token_healing_text_is_not_streamed_twice(tiny):
    chunks, state = collect(ss.text(tiny).stream("The url is http", max_tokens=5, token_healing=True))
    assert "".join(chunks) == state.value


@pytest.mark.real
def test_token_healing_on_real_model(real):
    for prompt in ["The url is http", "Visit our site at https:"]:
        ids = real.encode(prompt)
        k = ss.constraints.healing.heal_span(real.vocab, ids)
        assert k >= 1
        healed = ss.text(real)(prompt, max_tokens=6, token_healing=True)
        assert str(healed).startswith(prompt)
        # the first generated token merges the backed-up text with what follows
        merged = real.vocab.token_bytes[healed.token_ids[0][0][len(ids) - k]]
        removed = real.vocab.bytes_of(ids[-k:])
        assert merged.startswith(removed) or removed.startswith(merged)   # the healing constraint
        assert "://" in str(healed)
        if prompt.endswith("http"):       # " http" was re-tokenized, e.g. " " + "https"
            assert healed.token_ids[0][0][len(ids) - k: len(ids)] != ids[-k:]


def test_token_healing_with_choice(tiny):
    s = ss.choice(tiny, ["s://a.com", "://b.org"])("The url is http", token_healing=True)
    assert str(s) in ("The url is https://a.com", "The url is http://b.org")
    assert s.value in ("s://a.com", "://b.org")
