"""The second real family on the vllm engine: Gemma 3 270M served by vLLM (its GGUF
dequantized to fp32 safetensors, as the HF engine loads it) against the HF engine on the same
weights.  Gemma's 262,144-token vocabulary, BOS and 512-token sliding window all reach the
server and its plugin: greedy ids equal, log-probs within fp32 noise (`assert_close`, from
the HF model's noise floor measured on this CPU), constraints equal to local cursors, beams,
scores and next-token distributions equal.
"""

from __future__ import annotations

import pytest

import seqstate as ss
from conftest import assert_close, assert_same_rows

pytestmark = [pytest.mark.vllm, pytest.mark.real]

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
LONG = "The history of the lighthouse keeper's long and quiet life. " * 48 + "In the end,"

PROGRAMS = {
    "text": lambda m: ss.text(m)(["Once upon a time", "The capital of France is"],
                                 max_tokens=16),
    "past the sliding window": lambda m: ss.text(m)(LONG, max_tokens=8),
    "json": lambda m: ss.json(m, PERSON)("Bob is 42. JSON:", max_tokens=30),
    "regex, then a choice": lambda m: ss.choice(m, ["Paris", "Lyon"])(
        ss.regex(m, r"[0-9]{2}")("Two digits:") + " The capital of France is "),
    "beam": lambda m: ss.text(m)("Say a word:", sampler=ss.beam_search(2), max_tokens=4),
}


@pytest.mark.parametrize("program", PROGRAMS)
def test_gemma_on_vllm_equals_the_hf_engine(gemma_vllm, gemma, program):
    got, want = PROGRAMS[program](gemma_vllm), PROGRAMS[program](gemma)
    assert got.shape == want.shape
    assert_same_rows(got, want)
    assert all(a.tokens[0] == gemma.hf_tokenizer.bos_token_id for a in got.rows)


def test_gemma_scores_and_next_logprobs_on_vllm_equal_the_hf_engine(gemma_vllm, gemma):
    def state(model):
        return ss.text(model)("The capital of France is", max_tokens=3)

    served, local = state(gemma_vllm), state(gemma)
    options = [" Paris", " and Lyon, a city"]
    terms = max(len(gemma.encode(o)) for o in options)
    assert_close(served.score(options).sums, local.score(options).sums, gemma,
                 "vLLM's score sums vs the HF engine's", terms=terms)
    assert_close(served.next_logprobs(), local.next_logprobs(), gemma,
                 "vLLM's next_logprobs vs the HF engine's")
