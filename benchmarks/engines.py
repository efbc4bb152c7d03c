"""The llama.cpp engine vs llama-cpp-python's own generate and vs the HF engine (issue 12).

Greedy decode at batch 1 on the shipped GGUF; the fork case (8 samples x 32 tokens from a
512-token prompt) and the chained program (6 steps x 12 tokens) on both engines.
"""

from __future__ import annotations

import torch

import seqstate as ss
from benchmarks.harness import best_of, interleaved, report
from benchmarks.programs import chained_seqstate
from seqstate.engine import RowRequest, generate
from seqstate.sampling import greedy, multinomial

NEW = 64
PROMPT = "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper who"


def ours(model, rows, n, sampler=None) -> float:
    model.store.clear()
    out = generate(model, [RowRequest(tuple(r), n) for r in rows], sampler or greedy(),
                   torch.Generator().manual_seed(0))
    return out


def llama_generate(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    out = []
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return out


def main(model) -> None:
    try:
        import llama_cpp
        fast = ss.models.default(engine="llama.cpp")
    except (ImportError, ss.ModelNotAvailable) as exc:
        print(f"  llama.cpp engine unavailable: {exc}")
        return
    ids = fast.encode(PROMPT)
    llm = llama_cpp.Llama(model_path=str(ss.models.default_gguf()), n_ctx=4096, verbose=False,
                          flash_attn=True, type_v=llama_cpp.GGML_TYPE_Q8_0,
                          n_threads=fast.backend.n_threads)
    mine = list(ours(fast, [ids], NEW)[0].tokens[len(ids):])
    theirs = llama_generate(llm, ids, NEW)
    same = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine))
    theirs_t, mine_t = interleaved([lambda: llama_generate(llm, ids, NEW),
                                    lambda: ours(fast, [ids], NEW)])
    report(f"greedy decode, batch 1, {NEW} new tokens (llama.cpp engine)", [
        ("llama-cpp-python Llama.generate", theirs_t, ""),
        ("seqstate, llama.cpp engine", mine_t,
         f"identical for the first {same} of {NEW} tokens"),
        ("seqstate, hf engine", best_of(lambda: ours(model, [ids], NEW), repeat=1), ""),
    ], "llama-cpp-python Llama.generate")

    long = model.encode("The history of the lighthouse. " * 80)[:512]
    for label, m in (("hf", model), ("llama.cpp", fast)):
        before = m.stats
        t = best_of(lambda: ours(m, [long] * 8, 32, multinomial(0.8)), repeat=1)
        used = m.stats - before
        report(f"fork: 8 samples x 32 tokens from a 512-token prompt ({label})", [
            (f"{label} engine", t, f"prefill {used.prefill_tokens} tok over 2 runs"),
        ], f"{label} engine")
    report("chained program: 6 steps x 12 tokens", [
        ("hf engine", best_of(lambda: chained_seqstate(model), repeat=1), ""),
        ("llama.cpp engine", best_of(lambda: chained_seqstate(fast), repeat=1), ""),
    ], "hf engine")
