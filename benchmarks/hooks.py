"""Banned phrases: 1,000 phrases vs unconstrained generation."""

from __future__ import annotations

import random

import seqstate as ss
from benchmarks.harness import best_of, report


def main(model) -> None:
    rnd = random.Random(0)
    words = [model.vocab.decode([i]).strip() for i in range(1000, 6000)]
    words = [w for w in words if w.isalpha() and len(w) > 2]
    phrases = [" ".join(rnd.sample(words, 2)) for _ in range(999)] + ["metropolis"]
    hook = ss.hooks.ban_phrases(phrases)
    text = ss.text(model)
    prompt = "Once upon a time"

    def plain():
        return text(prompt, max_tokens=48)

    def banned():
        return text(prompt, max_tokens=48, hooks=[hook])

    out = banned()
    report("1,000 banned phrases, 48 tokens", [
        ("unconstrained", best_of(plain, repeat=3), ""),
        ("ban_phrases(1000)", best_of(banned, repeat=3),
         f"'metropolis' avoided: {'metropolis' not in out.value.lower()}"),
    ], "unconstrained")
