"""The state contract on every engine: the tiny HF model (exact), the GGUF on llama.cpp and
the default model on a vLLM server.

Exactness is each engine against its reference (conftest's `reference`): its own fresh
evaluation of the same tokens (HF to fp32 noise, the bound `assert_close` derives from the
noise floor measured on this CPU and capped at the exactness bound's 1e-3 (docs/engines.md); llama.cpp within its declared
noise floor, see seqstate.backends.llamacpp), and for the server, which has no full logits, the
HF engine on the same fp32 weights.
"""

from conftest import (assert_close, assert_fresh, assert_greedy, collect, fresh_logprobs,
                      prefill_slack, verify_store)
from pydantic import BaseModel

import seqstate as ss
from seqstate.hooks import Rollback

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:"]


class Pet(BaseModel):
    name: str
    legs: int


def test_greedy_text_and_its_logprobs_equal_the_reference(engine, reference):
    """Tokens: HF generate's (hf; vllm: on the server's weights), llama.cpp's fresh argmax;
    each generated token's log-prob: the reference's fresh evaluation's.  (Batched here: a
    row's result equals the row alone, test_a_calls_result_does_not_depend_on_what_else_runs.)"""
    state = ss.text(engine)(PROMPTS, max_tokens=12)
    assert_greedy(reference, state)
    for row in state.rows:
        ids, fresh = row.tokens, fresh_logprobs(reference, row.tokens)
        got = [(lp, fresh[p - 1, ids[p]]) for p, lp in enumerate(row.logprobs)
               if lp is not None]
        assert_close(*zip(*got), reference, "a generated token's log-prob", cap=1e-3)


def test_every_generator_kind(engine, reference):
    prompt = "Q: a pet and a number.\nA:"
    s = ss.text(engine)(prompt, max_tokens=5)
    assert s.finish_reason in ("max_tokens", "eos") and str(s).startswith(prompt)
    assert ss.choice(engine, ["cat", "catalog"])(s + " pet: ").value in ("cat", "catalog")
    assert ss.regex(engine, r"[0-9]{1,3}")(s + " n=").value.isdigit()
    pet = ss.json(engine, Pet)(s + " JSON: ", max_tokens=60)
    assert pet.finish_reason in ("constraint_complete", "max_tokens")
    expr = ss.cfg(engine, ss.grammars.load("arithmetic"))(s + " 1+", max_tokens=8)
    assert expr.finish_reason in ("constraint_complete", "max_tokens")
    assert_fresh(engine, reference, pet)


def test_continuing_prefills_only_new_tokens(engine, reference):
    text = ss.text(engine)
    s = text("The three primary colours are", max_tokens=6)
    before = engine.stats
    s2 = text(s + " and", max_tokens=4)
    used = engine.stats - before
    # only the last generated token and " and" lack KV (a server reuses whole blocks)
    slack = prefill_slack(engine)
    assert used.prefill_tokens <= 1 + len(engine.encode(" and")) + slack
    assert used.cached_tokens_reused >= len(s.token_ids[0][0]) - 1 - slack
    assert_fresh(engine, reference, s2)


def test_slice_back_fork_and_concat_keep_exact_kv(engine, reference):
    text = ss.text(engine)
    s = text("Once upon a time", max_tokens=8)
    short = s[..., :-3]
    before = engine.stats
    forks = text(short, num_samples=3, sampler=ss.multinomial(temperature=1.0), seed=1,
                 max_tokens=4)
    used = engine.stats - before
    assert used.prefill_tokens <= 1 + prefill_slack(engine)   # the prompt's KV came from s
    assert forks.shape == (1, 3)
    assert all(ids[: len(short.token_ids[0][0])] == short.token_ids[0][0]
               for ids in forks.token_ids[0])
    both = forks[:, :2, :] + ss.from_tokens(engine, [engine.encode(" The end.")])
    assert both.shape == (1, 2)
    assert_fresh(engine, reference, forks)
    assert_fresh(engine, reference, text(both, max_tokens=2))


def test_resume_continues_the_constraint(engine):
    gen = ss.regex(engine, r"[a-z]{4}-[0-9]{4}")
    s = gen("Code: ", max_tokens=20)
    assert s.finish_reason == "constraint_complete"
    back = s[..., :-2]
    again = gen.resume(back)
    assert again.finish_reason == "constraint_complete"
    assert len(again.value) == 9 and again.value[:4].isalpha()


def test_hooks_rollback_and_banned_phrases(engine, reference):
    text = ss.text(engine)
    free = text("Once upon a time", max_tokens=12)
    word = free.value.split()[1] if len(free.value.split()) > 1 else free.value.strip()
    ban = ss.hooks.ban_phrases([word])
    clean = text("Once upon a time", max_tokens=12, hooks=[ban])
    assert word.lower() not in clean.value.lower()
    fired = []

    def back_two(event):
        if len(event.generated) == 4 and not fired:
            fired.append(event.generated[2])
            return Rollback(2)
        return None

    s = text("Hello there", max_tokens=6, hooks=[back_two])
    assert fired and len(s.token_ids[0][0]) == len(engine.encode("Hello there")) + 6
    assert_fresh(engine, reference, s)


def test_beam_search_and_option_scoring(engine, reference):
    beam = ss.beam_search(2)
    s = ss.text(engine)("The best fruit is", sampler=beam, max_tokens=3)
    assert s.shape == (1, 2)
    s = ss.choice(engine, ["apples", "pears"])(s + " or ", sampler=beam)
    values = [row.spans[-1].value for row in s.rows]
    assert s.shape[1] >= 1 and set(values) <= {"apples", "pears"}
    assert len({str(row) for row in s.rows}) == len(s.rows)    # beams are different texts
    # weights are the sums of the reference's log-probs of every generated token
    for ids, lps in zip(s.token_ids[0], s.logprobs[0]):
        fresh = fresh_logprobs(reference, ids)
        for pos, lp in enumerate(lps):
            if lp is not None:
                assert_close(lp, fresh[pos - 1, ids[pos]], reference,
                             "a beam token's log-prob", cap=1e-3)
    scored = ss.choice(engine, ["yes", "no"], method="score")("Is water wet? Answer:")
    assert set(scored.scores) == {"yes", "no"}


def test_streaming_chunks_equal_the_value(engine):
    stream = ss.text(engine).stream("Count: 1, 2,", max_tokens=12, stop_at=", 6")
    chunks, state = collect(stream)
    assert "".join(chunks) == state.value


def test_store_is_consistent_after_everything(engine):
    ss.text(engine)(["a", "b", "c"], num_samples=2, sampler=ss.multinomial(), seed=3, max_tokens=3)
    verify_store(engine)


def test_a_calls_result_does_not_depend_on_what_else_runs(engine, reference):
    """Prompts generated together equal each generated alone, token for token, and so do
    programs under run_batch, several at once (on llama.cpp, freed cells reused out of
    position order once flipped greedy at a near-tie for one of these prompts)."""
    prompts = [f"Q: Is {i} an even number? Think briefly.\nA:" for i in range(20, 25)]
    text = ss.text(engine)
    together = text(prompts, max_tokens=12)
    alone = [text(p, max_tokens=12).token_ids[0] for p in prompts]
    assert together.token_ids == alone
    assert_fresh(engine, reference, together)

    def program(prompt):
        s = text(prompt, max_tokens=6)
        return text(s + " So:", max_tokens=4).token_ids[0][0]

    assert ss.run_batch(program, prompts, concurrency=5, progress=False) == \
        [program(p) for p in prompts]
    verify_store(engine)
