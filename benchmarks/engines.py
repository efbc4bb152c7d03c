"""The llama.cpp engine vs llama-cpp-python's own generate and vs the HF engine, and the KV
configurations llama.cpp offers, for speed and batch independence.

Greedy decode at batch 1 on the shipped GGUF; the fork case (8 samples x 32 tokens from a
512-token prompt) and the chained program (6 steps x 12 tokens) on both engines.

KV configurations: raw llama-cpp-python (its ctypes API, no seqstate in the loop), 2 threads,
one context per configuration, timed in turns.  Prefill of 512 and 2,042 tokens, decode of 64
tokens after a 512-token prompt, and batch independence: the largest logit difference between
five prompts prefilled and decoded together in one ubatch and each alone.  seqstate's engine
needs that difference to be 0.0 (a call's result must not depend on what else runs).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import seqstate as ss
from benchmarks.harness import best_of, interleaved, report
from benchmarks.programs import chained_seqstate
from seqstate.engine import Decoding, RowRequest, generate
from seqstate.sampling import greedy, multinomial

NEW = 64
PROMPT = "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper who"


def ours(model, rows, n, sampler=None) -> float:
    model.store.clear()
    out = generate(model, [RowRequest(tuple(r), n) for r in rows],
                   Decoding(sampler or greedy(), torch.Generator().manual_seed(0)))
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
                          n_threads=fast.backend.n_threads, **fast.backend.reference_options)
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
    llm.close()
    kv_configurations()


# -- KV configurations ------------------------------------------------------------------------

THREADS = 2                   # as the engine runs on this 2-core machine
PREFILLS = (512, 2042)
DECODE = 64
EVEN = [f"Q: Is {i} an even number? Think briefly.\nA:" for i in range(20, 25)]


def _configurations(ll) -> list[tuple[str, dict]]:
    f16, q8 = ll.GGML_TYPE_F16, ll.GGML_TYPE_Q8_0
    return [
        ("flash attn, K f16, V q8_0 (seqstate)", dict(flash=True, type_k=f16, type_v=q8)),
        ("flash attn, K q8_0, V q8_0", dict(flash=True, type_k=q8, type_v=q8)),
        ("flash attn, K f16, V f16 (default)", dict(flash=True, type_k=f16, type_v=f16)),
        ("no flash attn, K f16, V f16", dict(flash=False, type_k=f16, type_v=f16)),
    ]


class _Context:
    """One llama.cpp context with a unified KV cache, fed through llama_decode directly."""

    def __init__(self, ll, model, *, flash: bool, type_k: int, type_v: int,
                 threads: int) -> None:
        self.ll = ll
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 2688, 512, 512, 8
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified, params.no_perf = True, True
        params.flash_attn_type = (ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                                  else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.type_k, params.type_v = type_k, type_v
        self.ctx = ll.llama_init_from_model(model, params)
        self.batch = ll.llama_batch_init(512, 0, 1)
        self.vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)

    def clear(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def feed(self, rows: list[list[int]], starts: list[int] | None = None) -> torch.Tensor:
        """Every ``row[start:]`` (row j as sequence j) in decodes of 512; logits of each
        row's last token."""
        items = [(row[p], p, j, p == len(row) - 1) for j, row in enumerate(rows)
                 for p in range(starts[j] if starts else 0, len(row))]
        out = []
        for lo in range(0, len(items), 512):
            chunk = items[lo: lo + 512]
            for i, (t, p, j, last) in enumerate(chunk):
                self.batch.token[i], self.batch.pos[i] = t, p
                self.batch.n_seq_id[i], self.batch.seq_id[i][0], self.batch.logits[i] = 1, j, last
            self.batch.n_tokens = len(chunk)
            if self.ll.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            n = sum(c[3] for c in chunk)
            if n:
                ptr = self.ll.llama_get_logits(self.ctx)
                out.append(torch.from_numpy(np.ctypeslib.as_array(ptr, (n, self.vocab)).copy()))
        return torch.cat(out)


def _independence(c: _Context, prompts: list[list[int]]) -> float:
    """Max abs logit difference between each prompt evaluated alone and the prompts run
    together as the engine runs them: all prefilled in one ubatch, then all last tokens
    decoded in one (and, as a second case, whole prompts packed in one ubatch)."""
    alone = []
    for p in prompts:
        c.clear()
        alone.append(c.feed([p])[0])
    c.clear()
    c.feed([p[:-1] for p in prompts])
    decoded = c.feed(prompts, [len(p) - 1 for p in prompts])
    c.clear()
    packed = c.feed(prompts)
    return max((got[j] - alone[j]).abs().max().item()
               for got in (decoded, packed) for j in range(len(prompts)))


def kv_configurations(repeat: int = 3, threads: int = THREADS) -> None:
    import llama_cpp as ll

    from seqstate.backends.llamacpp.native import quiet_logs
    from seqstate.models.loading import default_tokenizer

    quiet_logs()
    tok = default_tokenizer()
    ids = tok.encode("The history of the lighthouse, told slowly and at length. " * 260)
    model = ll.llama_model_load_from_file(str(ss.models.default_gguf()).encode(),
                                          ll.llama_model_default_params())
    contexts = [(name, _Context(ll, model, threads=threads, **cfg))
                for name, cfg in _configurations(ll)]
    prompts = [tok.encode(p) for p in EVEN]
    exact = {name: _independence(c, prompts) for name, c in contexts}
    times = {(name, what): [] for name, _ in contexts for what in (*PREFILLS, "decode")}
    for _ in range(repeat):                        # in turns: the machine's load hits all alike
        for name, c in contexts:
            for n in PREFILLS:
                c.clear()
                t0 = time.perf_counter()
                c.feed([ids[:n]])
                times[(name, n)].append(time.perf_counter() - t0)
            c.clear()
            c.feed([ids[:512]])
            t0 = time.perf_counter()
            for j in range(512, 512 + DECODE):
                c.feed([ids[: j + 1]], [j])
            times[(name, "decode")].append(time.perf_counter() - t0)
    print(f"\n== KV configurations, raw llama-cpp-python, {threads} threads, median tok/s "
          f"(slowest-fastest of {repeat})")
    print(f"  {'':38} {'prefill 512':>17} {'prefill 2042':>17} {'decode':>15}   batched vs alone")
    for name, c in contexts:
        cells = []
        for what, n in ((512, 512), (2042, 2042), ("decode", DECODE)):
            ts = times[(name, what)]
            cells.append(f"{n / statistics.median(ts):6.0f} ({n / max(ts):.0f}-{n / min(ts):.0f})")
        print(f"  {name:<38} {cells[0]:>17} {cells[1]:>17} {cells[2]:>15}   "
              f"max |dlogit| {exact[name]:.3f}")
        c.close()
    ll.llama_model_free(model)
