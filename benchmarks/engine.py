"""Decode speed vs a hand-written HF loop and HF generate; the fork case."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from benchmarks.harness import best_of, interleaved, report
from seqstate.engine import Decoding, RowRequest, generate
from seqstate.sampling import greedy, multinomial

NEW = 64


def hand_loop(model, ids: list[int], n: int) -> list[int]:
    """The minimal greedy loop: one prefill, then one forward per token over a DynamicCache."""
    hf = model.hf_model
    cache = DynamicCache(config=hf.config)
    out = []
    with torch.inference_mode():
        logits = hf(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        for _ in range(n):
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            logits = hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits
    return out


def hf_generate(model, rows: list[list[int]], n: int, **kw):
    tok = model.hf_tokenizer
    tok.padding_side = "left"
    width = max(len(r) for r in rows)
    ids = torch.tensor([[model.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.inference_mode():
        return model.hf_model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                       pad_token_id=model.pad_token_id, **kw)


def ours(model, rows, n, sampler=None, seed=0):
    model.store.clear()
    return generate(model, [RowRequest(tuple(r), n) for r in rows],
                    Decoding(sampler or greedy(), torch.Generator().manual_seed(seed)))


def main(model) -> None:
    prompt = model.encode("Once upon a time, in a small village by the sea, there lived an old lighthouse keeper who")
    one = [prompt]
    rows = [prompt, *[model.encode(f"Describe the colour number {i} of the rainbow in detail.") for i in range(7)]]
    # greedy must stay identical to the hand loop while it is measured
    assert list(ours(model, one, NEW)[0].tokens[len(prompt):])[:8] == hand_loop(model, prompt, 8)
    # timed in turns, so that other processes and the worker thread's OpenMP team (which,
    # while it lives, changes how every thread's team waits) weigh on each alike
    # min_new_tokens is not ours: EOS would end rows early, so budget the same tokens via max_new
    t_hand, t_hf, t_ours = interleaved([lambda: hand_loop(model, prompt, NEW),
                                        lambda: hf_generate(model, one, NEW, do_sample=False),
                                        lambda: ours(model, one, NEW)], repeat=5)
    report(f"greedy decode, batch 1, {NEW} new tokens", [
        ("hand loop (HF forward + DynamicCache)", t_hand, ""),
        ("HF generate", t_hf, ""),
        ("seqstate", t_ours, f"{NEW / t_ours:.1f} tok/s"),
    ], "hand loop (HF forward + DynamicCache)")
    t_hf8 = best_of(lambda: hf_generate(model, rows, NEW, do_sample=False), repeat=2)
    t_ours8 = best_of(lambda: ours(model, rows, NEW), repeat=2)
    report(f"greedy decode, batch 8, {NEW} new tokens", [
        ("HF generate", t_hf8, ""),
        ("seqstate", t_ours8, f"{8 * NEW / t_ours8:.1f} tok/s"),
    ], "HF generate")
    long_prompt = (prompt * 40)[:512]
    t_hf_fork = best_of(lambda: hf_generate(model, [long_prompt], 32, do_sample=True,
                                            num_return_sequences=8, top_k=0), repeat=2)
    t_ours_fork = best_of(lambda: ours(model, [long_prompt] * 8, 32, multinomial()), repeat=2)
    before = model.stats
    ours(model, [long_prompt] * 8, 32, multinomial())
    after = model.stats
    per_token = model.num_layers * 2 * model.kv_heads * model.head_dim * 4
    report("fork: 512-token prompt, 8 samples x 32 tokens", [
        ("HF generate(num_return_sequences=8)", t_hf_fork, ""),
        ("seqstate (8 rows, one prefill)", t_ours_fork,
         f"prefill {after.prefill_tokens - before.prefill_tokens} tok, stored "
         f"{after.kv_bytes_cached / per_token:.0f} token-KVs (<= {512 + 8 * 32})"),
    ], "HF generate(num_return_sequences=8)")
