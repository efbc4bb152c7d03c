"""Beam search over a 3-call program vs HF generate(num_beams=4) per call."""

from __future__ import annotations

import time

import torch

import seqstate as ss
from benchmarks.harness import report

PROMPT = "Q: name a country in Europe.\nA:"


def ours(model):
    model.store.clear()
    beam = ss.beam_search(4)
    s = ss.text(model)(PROMPT, max_tokens=8, stop_at="\n", sampler=beam)
    s = ss.text(model)(s + "Its capital city is", max_tokens=8, stop_at="\n", sampler=beam)
    s = ss.choice(model, ["small", "large"])(s + "\nIs it small or large? ", sampler=beam)
    return s


def hf(model):
    """The same program with HF beam search per call and the best text re-sent as a string."""
    tok, hf_model = model.hf_tokenizer, model.hf_model
    per_token = model.num_layers * 2 * model.kv_heads * model.head_dim * 4
    peak = 0

    def call(prompt, n):
        nonlocal peak
        ids = torch.tensor([model.encode(prompt)])
        with torch.inference_mode():
            out = hf_model.generate(ids, num_beams=4, max_new_tokens=n, do_sample=False,
                                    pad_token_id=model.pad_token_id, early_stopping=True)
        peak = max(peak, 4 * out.shape[1] * per_token)
        return prompt + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]

    text = call(PROMPT, 8) + "\n"
    text = call(text + "Its capital city is", 8) + "\n"
    text = call(text + "Is it small or large? ", 2)
    return text, peak


def main(model) -> None:
    ours(model)
    t0 = time.perf_counter()
    s = ours(model)
    t_ours = time.perf_counter() - t0
    kv_ours = model.stats.kv_bytes_cached
    hf(model)
    t0 = time.perf_counter()
    _, kv_hf = hf(model)
    t_hf = time.perf_counter() - t0
    report("beam(4) over a 3-call program (text, text, choice)", [
        ("HF generate(num_beams=4) per call", t_hf, f"peak KV {kv_hf / 2**20:.1f} MiB per call, "
                                                    "one best string carried between calls"),
        ("seqstate beam_search(4)", t_ours, f"KV stored {kv_ours / 2**20:.1f} MiB for all beams, "
                                            f"{s.shape[1]} ranked programs returned"),
    ], "HF generate(num_beams=4) per call")
