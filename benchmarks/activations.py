"""An ACDC-style activation-patching sweep: seqstate's hooked runs over a stored prefix vs
TransformerLens's way (a full forward with torch hooks for every patched run).

A 400-token shared prefix, then a clean and a corrupt 10-token suffix.  30 (layer, position)
patches: the corrupt run with one position of one layer's residual stream replaced by the
clean run's.  seqstate feeds the prefix once (``prefix.next_logprobs()`` stores it), reads the
clean run's activations of the 10 suffix positions (``run_with_cache``) and runs each patch
over the suffix only (``with_hooks(...).next_logprobs()``).  TransformerLens's way, done
with plain HF forwards and torch hooks, as its ``run_with_cache`` / ``run_with_hooks`` do:
one full forward caching the clean activations, then one full forward per patch.  Both
sweeps are timed from an empty store, and their patched log-probs compared.
"""

from __future__ import annotations

import statistics
import time

import torch

import seqstate as ss
from benchmarks.harness import report

PREFIX, SUFFIX = 400, 10
TEXT = ("The committee met on Tuesday to review the harbour project. Engineers described the "
        "new breakwater, the dredging schedule and the costs of moving the ferry terminal. ")


def _prompts(model) -> tuple[list[int], list[int], list[int]]:
    """The shared prefix and the clean and corrupt suffixes (token ids)."""
    prefix = model.encode_prompt(TEXT * 20)[:PREFIX]
    clean = model.encode(" Then John and Mary went home, and John gave a drink to")[:SUFFIX]
    corrupt = model.encode(" Then John and Mary went home, and Mary gave a drink to")[:SUFFIX]
    assert len(prefix) == PREFIX and len(clean) == len(corrupt) == SUFFIX
    return prefix, clean, corrupt


def main(model, repeat: int = 3) -> None:
    prefix_ids, clean_ids, corrupt_ids = _prompts(model)
    n = model.num_layers
    layers = sorted({round(i * (n - 1) / 5) for i in range(6)})
    positions = [PREFIX + 2 * k for k in range(5)]
    patches = [(layer, p) for layer in layers for p in positions]
    assert len(patches) == 30
    names = [f"blocks.{layer}.hook_resid_pre" for layer in layers]

    def seqstate_sweep() -> torch.Tensor:
        model.backend.store.clear()
        prefix = ss.from_tokens(model, [prefix_ids])
        prefix.next_logprobs()                                      # the prefix, fed once
        clean = ss.from_tokens(model, [prefix_ids + clean_ids])
        corrupt = ss.from_tokens(model, [prefix_ids + corrupt_ids])
        cache = clean.run_with_cache(names, start=PREFIX)
        out = []
        for layer, p in patches:
            name = f"blocks.{layer}.hook_resid_pre"
            value = cache.at(name, p)

            def patch(act, pos, p=p, value=value):
                act[pos.at(p)] = value

            hooked = corrupt.with_hooks({name: patch}, start=PREFIX)
            out.append(hooked.next_logprobs()[0, 0])
        return torch.stack(out)

    decoder = model.hf_model.get_decoder().layers

    @torch.inference_mode()
    def full_forwards() -> torch.Tensor:
        """TransformerLens's way: every run a full forward, hooks on the layers' inputs."""
        clean_act: dict[int, torch.Tensor] = {}

        def keep(layer):
            def hook(module, args, kwargs):
                clean_act[layer] = (args[0] if args else kwargs["hidden_states"]).clone()
            return hook

        handles = [decoder[layer].register_forward_pre_hook(keep(layer), with_kwargs=True)
                   for layer in layers]
        try:
            model.hf_model(input_ids=torch.tensor([prefix_ids + clean_ids]), use_cache=False,
                           logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
        out = []
        for layer, p in patches:
            def patch(module, args, kwargs, layer=layer, p=p):
                hidden = (args[0] if args else kwargs["hidden_states"]).clone()
                hidden[:, p] = clean_act[layer][:, p]
                return ((hidden, *args[1:]), kwargs) if args else (
                    args, {**kwargs, "hidden_states": hidden})

            handle = decoder[layer].register_forward_pre_hook(patch, with_kwargs=True)
            try:
                logits = model.hf_model(input_ids=torch.tensor([prefix_ids + corrupt_ids]),
                                        use_cache=False, logits_to_keep=1).logits
            finally:
                handle.remove()
            out.append(logits[0, -1].float().log_softmax(-1))
        return torch.stack(out)

    times: list[list[float]] = [[], []]
    for _ in range(repeat):                   # in turns, so that load affects both alike
        before = model.stats
        start = time.perf_counter()
        ours = seqstate_sweep()
        times[0].append(time.perf_counter() - start)
        used = model.stats - before
        print(f"  seqstate sweep: {times[0][-1]:.2f} s", flush=True)
        start = time.perf_counter()
        theirs = full_forwards()
        times[1].append(time.perf_counter() - start)
        print(f"  run: seqstate {times[0][-1]:.2f} s, full forwards {times[1][-1]:.2f} s",
              flush=True)
    diff = (ours - theirs).abs().max().item()
    ours_s, theirs_s = statistics.median(times[0]), statistics.median(times[1])
    report(f"ACDC-style sweep: 30 (layer, position) patches, {PREFIX}-token shared prefix, "
           f"{SUFFIX}-token suffix", [
               ("31 full forwards + torch hooks", theirs_s, "TransformerLens's way"),
               ("seqstate with_hooks", ours_s,
                f"tokens fed {used.prefill_tokens + used.decode_tokens} (the prefix once); "
                f"max |log-prob diff| {diff:.2e}"),
           ], "31 full forwards + torch hooks")
    print(f"  ratio: {theirs_s / ours_s:.2f}x (issue 52 asks >= 4x)")
