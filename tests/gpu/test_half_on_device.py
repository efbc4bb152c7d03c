"""Half precision on one device, through the documented loader: ``ss.models.transformers(folder,
device=..., dtype=torch.bfloat16)``.  `make gpu-check` runs it on CUDA, ``make test`` on the
CPU.  The model is the tiny random Llama saved to a folder and loaded back.

bfloat16 keeps 8 bits of mantissa, so two paths' logits (a padded batch against Hugging Face's
one row) differ by a few units of its last place times their magnitude; greedy output equals
Hugging Face ``generate`` up to a position where the reference's two tokens lie within that
bound of each other.  Float16 and bfloat16 rows whose logits overflow are refused with the
error that names the cause.
"""

from __future__ import annotations

import re

import pytest
import torch

import seqstate as ss
from conftest import hf_generate

PROMPTS = ["Hello there, my name is", "The capital of France"]
ULP = 2.0 ** -7          # bfloat16's spacing just above 1: 8 bits of mantissa
SPREAD = 8               # units of the last place two paths' logits may differ by (a sum of
                         # a hidden size of products, rounded at every layer)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """The tiny model and its tokenizer saved as a transformers checkpoint."""
    path = tmp_path_factory.mktemp("tiny-checkpoint")
    src = ss.models.testing.tiny()
    src.hf_model.save_pretrained(path)
    src.hf_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model(folder, device) -> ss.models.HFModel:
    return ss.models.transformers(folder, device=device, dtype=torch.bfloat16)


def test_the_loader_puts_the_weights_on_the_device_in_bfloat16(model, device):
    weight = next(model.hf_model.parameters())
    assert weight.device.type == device.type and weight.dtype == torch.bfloat16


def test_greedy_equals_hf_generate_up_to_bfloat16_ties(model):
    state = ss.text(model)(PROMPTS, max_tokens=12)
    for prompt, row in zip(PROMPTS, state.token_ids):
        ids = model.encode(prompt)
        got, want = row[0][len(ids):], hf_generate(model, ids, 12)
        for k, (a, b) in enumerate(zip(got, want)):
            if a != b:
                logits = model.full_logits(ids + want[:k])[-1].float()
                bound = SPREAD * ULP * float(logits.abs().max())
                gap = abs(float(logits[a] - logits[b]))
                assert gap <= bound, f"token {k}: {a} vs {b}, {gap:.3g} apart (bound {bound:.3g})"
                break
        else:
            assert len(got) == len(want)


def test_constrained_calls_are_valid_in_bfloat16(model):
    number = ss.regex(model, r"[0-9]{3}-[a-z]{2,4}")("Code: ", max_tokens=20)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", number.value or "")
    record = ss.json(model, {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"]})("Record: ", max_tokens=60)
    assert isinstance(record.value, dict) and set(record.value) == {"name", "ok"}


def test_scores_and_next_logprobs_come_back_in_full_precision(model):
    state = ss.from_tokens(model, [model.encode(PROMPTS[0])])
    scores = state.score([" Bob", " the king"])
    assert scores.sums.dtype == torch.float64 and torch.isfinite(scores.sums).all()
    lp = state.next_logprobs()
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
    # log-softmax: the probabilities sum to one in float32
    assert abs(float(lp[0, 0].exp().sum()) - 1.0) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_overflowed_logits_name_the_cause_on_the_device(folder, device, dtype):
    model = ss.models.transformers(folder, device=device, dtype=dtype)
    with torch.no_grad():        # a float16 cast of 1e6 is inf; in bfloat16 3e38 fits and overflows
        model.hf_model.model.layers[0].mlp.down_proj.weight[:] = \
            1e6 if dtype is torch.float16 else 3e38
    with pytest.raises(ss.LogitsError, match="overflowed"):
        ss.text(model)("Hello there", max_tokens=3)
