"""Golden results of the decode step: record them from one checkout, compare another's.

``python benchmarks/golden.py out.json`` (cwd = the checkout whose ``seqstate`` to import,
with that checkout first on ``PYTHONPATH``) runs every program of the overhead suite (text,
regex, JSON at 1, 16 and 64 rows, greedy) on the tiny model and on SmolLM2, plus seeded
multinomial sampling (free and constrained), banned phrases, greedy hooks that replace,
resample and roll back, stop strings and token healing, and writes every row's tokens,
log-probs and finish reason.

``python benchmarks/golden.py --compare before.json after.json`` says where two such files
differ: tokens and finish reasons must be identical, log-probs equal to ``--atol``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.getcwd())          # the checkout to record: its seqstate, its suites

import torch  # noqa: E402

import seqstate as ss  # noqa: E402
from benchmarks.overhead import NEW, PATTERN, ROWS, SCHEMA  # noqa: E402


def _record(state) -> dict:
    rows = [r for b in state.token_ids for r in b]
    logprobs = [r for b in state.logprobs for r in b]
    reasons = state.finish_reason
    flat = [r for b in reasons for r in b] if isinstance(reasons, list) and reasons \
        and isinstance(reasons[0], list) else reasons
    return {"tokens": rows, "logprobs": logprobs, "finish": [str(f) for f in
                                                             (flat if isinstance(flat, list) else [flat])]}


def _replace(event):
    """A greedy hook that replaces every token ending in 'e' with token 260."""
    return ss.hooks.Replace(260) if event.token_text.endswith("e") else None


def _backtrack(event):
    """A greedy hook that resamples after a space now and then and rolls back once in a
    while."""
    if event.position % 7 == 3 and event.token_text.startswith(" "):
        return ss.hooks.Resample()
    if len(event.text) > 12 and len(event.generated) > 3 and event.position % 11 == 0:
        return ss.hooks.Rollback(2)
    return None


def programs(model) -> dict:
    prompts = [model.encode("Write about the word") + [1000 + i] for i in range(max(ROWS))]
    gens = {"regex": ss.regex(model, PATTERN), "text": ss.text(model),
            "json": ss.json(model, SCHEMA)}
    out = {}
    for name, gen in gens.items():
        for rows in ROWS:
            model.store.clear()
            out[f"{name}/{rows}"] = _record(gen(ss.from_tokens(model, prompts[:rows]),
                                                max_tokens=NEW))
    text, js = gens["text"], gens["json"]
    many = ["Once upon a time", "The capital of France is", "def fib(n):", "Q: why?\nA:"]
    sampler = ss.multinomial(temperature=0.9, top_k=50, top_p=0.95)
    out["multinomial"] = _record(text(many, max_tokens=24, num_samples=3,
                                      sampler=ss.multinomial(), seed=7))
    out["multinomial/top"] = _record(text(many, max_tokens=24, num_samples=2, sampler=sampler,
                                          seed=3))
    out["multinomial/json"] = _record(js(many[:2], max_tokens=24, num_samples=2,
                                         sampler=ss.multinomial(temperature=0.8), seed=11))
    out["multinomial/nospec"] = _record(js(many[:2], max_tokens=16, num_samples=2,
                                           sampler=ss.multinomial(), seed=5, speculate=False))
    out["ban"] = _record(text(many, max_tokens=24,
                              hooks=[ss.hooks.ban_phrases(["the", "an", "is"])]))
    out["ban/sampled"] = _record(text(many, max_tokens=24, sampler=ss.multinomial(), seed=2,
                                      hooks=[ss.hooks.ban_phrases(["e"])]))
    out["hooks/replace"] = _record(text(many, max_tokens=24, hooks=[_replace]))
    out["hooks/backtrack"] = _record(text(many, max_tokens=24, hooks=[_backtrack]))
    out["hooks/json"] = _record(js(many[:2], max_tokens=24,
                                   hooks=[lambda e: ss.hooks.Resample() if e.position % 5 == 0
                                          else None]))
    out["stop"] = _record(text(many, max_tokens=40, stop_at=["\n", " the", "."]))
    out["healing"] = _record(text(["The URL is https://www.", "A big ca"], max_tokens=12,
                                  token_healing=True))
    out["regex/digits"] = _record(ss.regex(model, r"[0-9]{1,3}( apples)?")(many, max_tokens=8))
    out["choice"] = _record(ss.choice(model, ["Positive", "Negative", "Neutral"])(many))
    return out


def record(path: str, models: str = "tiny,smollm2") -> None:
    print(f"seqstate from {ss.__file__}", flush=True)
    torch.set_num_threads(1)
    result = {}
    loaders = {"tiny": ss.models.testing.tiny, "smollm2": ss.models.default}
    for label in models.split(","):
        load = loaders[label]
        model = load()
        for name, value in programs(model).items():
            result[f"{label}/{name}"] = value
            print(f"  {label}/{name}: {sum(map(len, value['tokens']))} tokens", flush=True)
    with open(path, "w") as f:
        json.dump(result, f)


def compare(before: str, after: str, atol: float) -> int:
    """Say where two records differ (only the programs both hold); 1 where any does."""
    with open(before) as f:
        a = json.load(f)
    with open(after) as f:
        b = json.load(f)
    both = set(a) & set(b)
    a, b = {k: a[k] for k in both}, {k: b[k] for k in both}
    bad = 0
    worst = 0.0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"{key}: only in {'before' if key in a else 'after'}")
            bad += 1
            continue
        x, y = a[key], b[key]
        if x["tokens"] != y["tokens"] or x["finish"] != y["finish"]:
            rows = [i for i, (p, q) in enumerate(zip(x["tokens"], y["tokens"])) if p != q]
            print(f"{key}: tokens or finish reasons differ (rows {rows[:8]})")
            bad += 1
            continue
        for p, q in zip(x["logprobs"], y["logprobs"]):
            for u, v in zip(p, q):
                if (u is None) != (v is None):
                    print(f"{key}: a log-prob is None on one side only")
                    bad += 1
                elif u is not None and not (math.isinf(u) and u == v):
                    worst = max(worst, abs(u - v))
    print(f"{len(a)} programs; {bad} differ in tokens; largest log-prob difference {worst:.2e}"
          f" (allowed {atol:.0e})")
    return 1 if bad or worst > atol else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/golden.py")
    parser.add_argument("files", nargs="+", help="OUT.json, or BEFORE.json AFTER.json with --compare")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--models", default="tiny,smollm2", help="record these: tiny, smollm2")
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.files, atol=args.atol))
    record(args.files[0], args.models)
