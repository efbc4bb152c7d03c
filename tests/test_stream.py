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


def test_healing_does_not_lose_prompt_text(tiny):
    s = ss.text(tiny)("The url is http", max_tokens=1, token_healing=True)
    assert str(s).startswith("The url is http") and len(str(s)) > len("The url is http")
    assert s.value and str(s) == "The url is http" + s.value
    # re-spell the healed "\n" with its own token, then write "ok": the stop must not fire early
    from seqstate.hooks import Replace

    spelled = tiny.encode("\n") + tiny.encode("ok")
    force = lambda e: Replace(spelled[len(e.generated)]) if len(e.generated) < 2 else None  # noqa: E731
    s = ss.text(tiny)("Line\n", stop_at="\n", token_healing=True, max_tokens=1, hooks=[force])
    assert str(s) == "Line\nok" and s.value == "ok" and s.finish_reason == "max_tokens"


@pytest.mark.real
def test_healing_budget_counts_only_new_text(real):
    s = ss.text(real)("The url is http", max_tokens=1, token_healing=True)
    assert str(s).startswith("The url is http")
    assert len(str(s)) > len("The url is http")


def test_token_healing_with_json_and_grammar(tiny):
    s = ss.json(tiny, {"type": "string", "enum": ["pears", "plums"]})('Fruit: "p', token_healing=True)
    assert str(s).startswith('Fruit: "p')
    if s.finish_reason == "constraint_complete":
        assert s.value in ("pears", "plums")
    g = ss.cfg(tiny, 'start: "plum" | "pear"')("I ate a p", token_healing=True, max_tokens=6)
    assert str(g).startswith("I ate a p")
