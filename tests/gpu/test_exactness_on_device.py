"""The exactness subset on one device: `make gpu-check` runs it with ``--device cuda`` where a
CUDA device exists; ``make test`` runs it on the CPU (the option's default), so its logic is
exercised everywhere.  The model is the tiny random Llama in float32, on the device.

References: Hugging Face ``generate`` on the same device, the CPU engine in float32 (the same
weights), and a fresh full forward.  Two devices' float32 logits differ in the last bits, so
where two token sequences part, the reference must show a tie within the exactness bound
(docs/engines.md: 1e-3 on logits) between the two tokens at that position; anything else fails.
"""

from __future__ import annotations

import re

import pytest
import torch

import seqstate as ss
from conftest import hf_generate

TIE = 1e-3        # the exactness bound on logits (docs/engines.md), between devices and paths
PROMPTS = ["Hello there, my name is", "The capital of France"]


@pytest.fixture(scope="module")
def cpu() -> ss.models.HFModel:
    """The CPU engine in float32: the reference for the device's results."""
    return ss.models.testing.tiny()


@pytest.fixture(scope="module")
def model(device) -> ss.models.HFModel:
    """The same weights (the same seed) on ``device``, through the public loader."""
    src = ss.models.testing.tiny()
    return ss.models.from_hf(src.hf_model.to(device), src.hf_tokenizer)


def fresh(model, tokens) -> torch.Tensor:
    """Float32 logits (T, V) of a fresh forward of ``tokens`` on ``model``, on the CPU."""
    return model.full_logits(list(tokens)).float().cpu()


def assert_same_up_to_ties(reference, prompt: list[int], got: list[int], want: list[int]) -> None:
    """``got`` equals ``want`` (tokens after ``prompt``), or both agree up to a position where
    ``reference``'s fresh logits hold the two tokens within `TIE` of each other."""
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b:
            logits = fresh(reference, prompt + want[:k])[-1]
            gap = abs(float(logits[a] - logits[b]))
            assert gap < TIE, f"token {k}: {a} vs {b}, logits {gap:.2e} apart (not a tie)"
            return
    assert len(got) == len(want), (got, want)


def generated(state) -> list[list[int]]:
    """Each row's tokens of its last call."""
    return [list(r.tokens[r.spans[-1].start: r.spans[-1].end]) for r in state.rows]


def test_the_model_is_on_the_device(model, device):
    assert model.device.type == device.type
    assert next(model.hf_model.parameters()).device.type == device.type


def test_greedy_equals_hf_generate(model):
    # two prompts of different lengths in one batch: padded rows, a 2-D mask, positions
    state = ss.text(model)(PROMPTS, max_tokens=16)
    for prompt, got in zip(PROMPTS, generated(state)):
        ids = model.encode(prompt)
        assert_same_up_to_ties(model, ids, got, hf_generate(model, ids, 16))


@pytest.mark.parametrize("build, valid", [
    (lambda m: ss.regex(m, r"[0-9]{3}-[a-z]{2,4}"),
     lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", s.value or "")),
    (lambda m: ss.json(m, {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"]}),
     lambda s: isinstance(s.value, dict) and set(s.value) == {"name", "ok"}),
])
def test_constrained_outputs_are_valid_and_equal_the_cpu_engines(model, cpu, build, valid):
    prompt = "Record: "
    ours, theirs = build(model)(prompt, max_tokens=60), build(cpu)(prompt, max_tokens=60)
    assert valid(ours) and valid(theirs)
    assert_same_up_to_ties(cpu, cpu.encode(prompt), generated(ours)[0], generated(theirs)[0])


def test_banned_tokens_are_masked_on_the_device(model, cpu):
    # ban what greedy would say first: the row resamples there with the token banned
    prompt = "Hello there, my name is"
    first = ss.text(cpu)(prompt, max_tokens=1).texts[0][0][len(prompt):]
    hooks = [ss.hooks.ban_phrases([first.strip() or first], ignore_case=False)]
    ours = ss.text(model)(prompt, max_tokens=6, hooks=hooks)
    theirs = ss.text(cpu)(prompt, max_tokens=6, hooks=hooks)
    assert (first.strip() or first) not in ours.texts[0][0][len(prompt):]
    assert_same_up_to_ties(cpu, cpu.encode(prompt), generated(ours)[0], generated(theirs)[0])


def test_seeded_sampling_runs_and_repeats_on_the_device(model):
    # a generator on the device (seed=), penalties' history tensors, and a CPU generator
    # passed as rng= (its draws moved to the device)
    sampler = ss.multinomial(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.2,
                             presence_penalty=0.5)
    one = ss.text(model)(PROMPTS, num_samples=3, sampler=sampler, seed=3, max_tokens=8)
    two = ss.text(model)(PROMPTS, num_samples=3, sampler=sampler, seed=3, max_tokens=8)
    assert one.token_ids == two.token_ids and one.shape == (2, 3)
    rng = [ss.text(model)(PROMPTS[0], sampler=sampler, max_tokens=8,
                          rng=torch.Generator().manual_seed(5)).token_ids for _ in range(2)]
    assert rng[0] == rng[1]


def test_scores_match_a_full_forward(model):
    ids = model.encode(PROMPTS[0])
    options = [" Bob", " the king of the world"]
    scores = ss.from_tokens(model, [ids]).score(options)
    for o, option in enumerate(options):
        cont = model.encode(option)
        want = fresh(model, ids + cont).log_softmax(-1)[len(ids) - 1: -1]       # (len(cont), V)
        want = want.gather(1, torch.tensor(cont)[:, None])[:, 0]
        got = torch.tensor(scores.logprobs[0][0][o], dtype=torch.float32)
        assert (got - want).abs().max() < TIE
    lp = ss.from_tokens(model, [ids]).next_logprobs()
    assert lp.device.type == model.device.type
    assert (lp[0, 0].cpu() - fresh(model, ids).log_softmax(-1)[-1]).abs().max() < TIE


def test_a_fork_and_a_slice_reuse_their_kv(model):
    state = ss.text(model)(PROMPTS[1], max_tokens=10)
    # a slice back: its KV kept (a view), only the last kept token fed again
    before = model.stats
    cut = state[..., :-4]
    again = ss.text(model)(cut, max_tokens=4)
    used = model.stats - before
    assert used.prefill_tokens == 0 and used.cached_tokens_reused > 0
    prompt = list(cut.token_ids[0][0])
    assert_same_up_to_ties(model, prompt, generated(again)[0], hf_generate(model, prompt, 4))
    # a fork: the prompt's KV shared by every sample; each sample's logits through it exact
    before = model.stats
    forked = ss.text(model)(state, num_samples=3, sampler=ss.multinomial(), seed=0, max_tokens=4)
    assert (model.stats - before).prefill_tokens == 0
    got = forked.next_logprobs().flatten(0, 1)                                  # (3, V)
    for row, lp in zip(forked.token_ids[0], got):
        assert (lp.cpu() - fresh(model, row).log_softmax(-1)[-1]).abs().max() < TIE
