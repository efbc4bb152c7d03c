"""The engine's own cost per decode step: text, JSON and regex calls vs a hand-written loop.

On a model whose forward costs almost nothing (``ss.models.testing.tiny()``, as a forward on a
GPU is next to the engine's Python), whatever the engine does around the forward shows: masks,
sampling, bookkeeping, detokenisation.  Every program decodes the same number of tokens per
row (the figures say how many it did), one thread, timed in turns with a batched HF forward
loop over a ``DynamicCache``; per decode step = a whole call (prompt prefill included on both
sides) divided by the tokens per row.  The table gives each loop's best run and its ratio to
the hand loop's best (what the machine allows; a shared VM's speed moves between runs), and
the ratios of the medians below it.

On the CPU it also prints each loop's own time per step: a call's wall time less the time
inside the model's forward (its causal LM or its decoder, outermost call), medians of the
interleaved runs.  It moves far less than the ratios when the machine's speed changes from
minute to minute (a VM shared with others), so compare engines by it on a noisy machine.

It pins glibc's malloc first (`harness.steady_allocator`): under glibc's moving thresholds a
loop's large tensors fault their pages in again at every step or not, depending on what the
process ran before, which swamped the ratios (docs/performance.md).

``python -m benchmarks overhead`` runs it on the tiny model and on SmolLM2 (this CPU);
``python -m benchmarks.overhead --device cuda`` runs it on a GPU, on the tiny model and on a
random-weight ~0.9B Llama in bfloat16 (a forward that costs what a real one of that size
costs; no weights needed), where the engine's own cost per step is what a GPU user pays.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import seqstate as ss
from benchmarks.harness import interleaved_runs, steady_allocator

NEW = 32
ROWS = (1, 16, 64)
# two string fields that cannot close within NEW tokens, so every row runs its whole budget
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 120},
                                           "city": {"type": "string", "minLength": 120}},
          "required": ["name", "city"]}
PATTERN = "[a-z ]{1,200}"


def prompts(model, gens: dict[str, object], rows: int) -> list[list[int]]:
    """``rows`` distinct prompts of the same length (no padding in the hand loop) after which
    every program decodes its whole budget: greedy may pick EOS where a constraint accepts
    (the regex after one letter), so prompts whose rows would end early are left out."""
    base = model.encode("Write about the word")
    full: list[list[int]] = []
    tried = 0
    while len(full) < rows and tried < 16 * rows:       # in chunks: a real model's are slow
        chunk = [base + [1000 + i] for i in range(tried, tried + rows)]
        tried += rows
        for gen in gens.values():
            if not chunk:
                break
            chunk = [p for p, c in zip(chunk, tokens_per_row(run(model, gen, chunk), chunk))
                     if c >= NEW]
        full += chunk
    if len(full) < rows:
        raise RuntimeError(f"only {len(full)} of {tried} prompts run {NEW} tokens "
                           f"in every program on {model.name}; {rows} are needed")
    return full[:rows]


def hand_loop(model, rows: list[list[int]], n: int) -> torch.Tensor:
    """Batched greedy decoding: one prefill, then one forward per token over a DynamicCache."""
    hf = model.hf_model
    cache = DynamicCache(config=hf.config)
    out = []
    with torch.inference_mode():
        logits = hf(torch.tensor(rows, device=hf.device), past_key_values=cache, use_cache=True,
                    logits_to_keep=1).logits
        for _ in range(n):
            tok = logits[:, -1].argmax(-1, keepdim=True)                                # (B, 1)
            out.append(tok)
            logits = hf(tok, past_key_values=cache, use_cache=True).logits
    return torch.cat(out, 1).cpu()           # the tokens on the host, as a caller reads them


def programs(model) -> dict[str, object]:
    # built once (compiled constraints are cached); hooks-free, greedy, no stop strings; the
    # regex first: it is the one whose rows may end early (see `prompts`)
    return {"regex": ss.regex(model, PATTERN), "text": ss.text(model), "json": ss.json(model, SCHEMA)}


def run(model, gen, rows: list[list[int]]) -> ss.SequenceState:
    model.store.clear()                  # prefill the prompts every time, as the hand loop does
    return gen(ss.from_tokens(model, rows), max_tokens=NEW)


class ForwardClock:
    """Seconds spent inside ``hf_model``'s forward (its causal LM or its decoder, whichever
    is called outermost), while in a ``with`` block."""

    def __init__(self, hf_model) -> None:
        self.modules = [hf_model, hf_model.get_decoder()]
        self.seconds = 0.0
        self._depth = 0

    def __enter__(self) -> ForwardClock:
        for module in self.modules:
            module.forward = self._timed(module.forward)     # the instance's, over its class's
        return self

    def __exit__(self, *exc) -> None:
        for module in self.modules:
            del module.forward

    def _timed(self, forward):
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds += time.perf_counter() - start
        return timed


def tokens_per_row(state, rows: list[list[int]]) -> list[int]:
    return [len(t) - len(p) for t, p in zip((r for b in state.token_ids for r in b), rows)]


def measure(model, label: str, repeat: int) -> None:
    gens = programs(model)
    print(f"\n== engine overhead per decode step: {label}, {NEW} new tokens, greedy, 1 thread")
    print(f"  {'rows':>4} {'hand loop':>10} " + " ".join(f"{n:>18}" for n in gens)
          + "   tokens/row (min-max)")
    chosen = prompts(model, gens, max(ROWS))
    for b in ROWS:
        rows = chosen[:b]
        counts = {n: tokens_per_row(run(model, g, rows), rows) for n, g in gens.items()}
        fns = [lambda: hand_loop(model, rows, NEW)]
        fns += [lambda g=g: run(model, g, rows) for g in gens.values()]
        forwards: list[list[float]] = [[] for _ in fns]

        def clocked(fn, out):
            def call():
                clock.seconds = 0.0
                fn()
                out.append(clock.seconds)
            return call

        with ForwardClock(model.hf_model) as clock:
            runs = interleaved_runs([clocked(f, o) for f, o in zip(fns, forwards)], repeat)
        # the best run of each (what the machine allows; its speed moves between runs), and
        # below it the medians' ratios; per step = per token of the row that ran longest (a
        # batch whose rows all stop early, as bfloat16 ties can make them, ran fewer steps)
        steps = [NEW] + [max(c) for c in counts.values()]
        best = [min(t) / n for t, n in zip(runs, steps)]
        median = [statistics.median(t) / n for t, n in zip(runs, steps)]
        cells = [f"{t * 1e3:7.2f} ms ({t / best[0]:4.2f}x)" for t in best[1:]]
        print(f"  {b:>4} {best[0] * 1e3:7.2f} ms " + " ".join(f"{c:>18}" for c in cells) + "   "
              + ", ".join(f"{n} {min(c)}-{max(c)}" for n, c in counts.items()))
        print(f"  {'':>4} medians: hand loop {median[0] * 1e3:.2f} ms, "
              + ", ".join(f"{n} {t / median[0]:.2f}x" for n, t in zip(gens, median[1:])))
        if model.backend.device.type == "cpu":       # a GPU's forward returns before it ends
            # the warmup's forwards are in each list first
            own = [statistics.median(w - f for w, f in zip(t, fw[-len(t):])) / n * 1e6
                   for t, fw, n in zip(runs, forwards, steps)]
            print(f"  {'':>4} own per step: hand loop {own[0]:.0f} us, "
                  + ", ".join(f"{n} {u:.0f} us" for n, u in zip(gens, own[1:])))


def main(model, repeat: int = 7) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print(steady_allocator())
    try:
        measure(ss.models.testing.tiny(), "tiny() (a forward that costs almost nothing)", repeat)
        measure(model, f"{model.name}", max(3, repeat // 2))
    finally:
        torch.set_num_threads(threads)


def random_llama(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> ss.models.HFModel:
    """A random-weight Llama of ~0.9B parameters (SmolLM2's tokenizer, 16 layers of 2,048) on
    ``device``: its forward costs what a real model's of that size does."""
    tok = ss.models.testing.tiny().hf_tokenizer
    config = LlamaConfig(vocab_size=len(tok), hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, attn_implementation="sdpa")
    with torch.device(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = LlamaForCausalLM(config).to(dtype).eval()
    return ss.models.from_hf(hf, tok)


def on_device(device: str, repeat: int = 5) -> None:
    """The suite on ``device``: the tiny model and a random ~0.9B Llama in bfloat16."""
    where = torch.device(device)
    name = torch.cuda.get_device_name(where) if where.type == "cuda" else device
    tiny = ss.models.testing.tiny()
    torch.set_num_threads(1)
    print(steady_allocator())
    measure(ss.models.from_hf(tiny.hf_model.to(where), tiny.hf_tokenizer),
            f"tiny() on {name}", repeat)
    measure(random_llama(where), f"a random 0.9B Llama in bfloat16 on {name}", repeat)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead")
    parser.add_argument("--device", default=None,
                        help="run on this device (cuda, cuda:1) instead of this CPU")
    args = parser.parse_args()
    if args.device is None:
        main(ss.models.default())
    else:
        on_device(args.device)
