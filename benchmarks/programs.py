"""Chained programs vs outlines re-prompting and guidance; constrained vs free decode."""

from __future__ import annotations

import time

from pydantic import BaseModel

import seqstate as ss
from benchmarks.harness import best_of, report

STEPS, TOKENS = 6, 12
START = "A numbered list of six ideas for a weekend:\n1."


DOCUMENT = ("Notes from the planning meeting. The team discussed budgets, travel, weather, "
            "food, music and the schedule for the coming months in great detail. ") * 14


def chained_seqstate(model, start: str = START) -> str:
    model.store.clear()
    text = ss.text(model)
    s = text(start, max_tokens=TOKENS)
    for i in range(2, STEPS + 1):
        s = text(s + f"\n{i}.", max_tokens=TOKENS)
    return str(s)


def chained_outlines(om, start: str = START) -> str:
    prompt = start
    for i in range(1, STEPS + 1):
        prompt += om(prompt, max_new_tokens=TOKENS)
        if i < STEPS:
            prompt += f"\n{i + 1}."
    return prompt


def chained_guidance(gm) -> str:
    from guidance import gen

    lm = gm + START
    for i in range(1, STEPS + 1):
        lm += gen(max_tokens=TOKENS)
        if i < STEPS:
            lm += f"\n{i + 1}."
    return str(lm)


class Record(BaseModel):
    title: str
    year: int
    tags: list[str]
    summary: str


def main(model) -> None:
    import outlines

    om = outlines.from_transformers(model.hf_model, model.hf_tokenizer)
    rows = [("seqstate (continues states)", best_of(lambda: chained_seqstate(model), repeat=2), "")]
    before = model.stats
    chained_seqstate(model)
    d = model.stats - before
    rows[0] = (rows[0][0], rows[0][1], f"prefill {d.prefill_tokens} tok total")
    rows.append(("outlines 1.x (re-prompt strings)", best_of(lambda: chained_outlines(om), repeat=2), ""))
    try:
        import guidance

        gm = guidance.models.Transformers(model.hf_model, model.hf_tokenizer)
        rows.append(("guidance (transformers model)", best_of(lambda: chained_guidance(gm), repeat=2), ""))
    except Exception as exc:                              # report, do not hide, a peer that fails
        print(f"  guidance unavailable: {type(exc).__name__}: {exc}")
    report(f"chained program: {STEPS} steps x {TOKENS} tokens", rows, "outlines 1.x (re-prompt strings)")
    long_start = DOCUMENT + START
    report(f"chained program after a {len(model.encode(DOCUMENT))}-token document", [
        ("seqstate (continues states)", best_of(lambda: chained_seqstate(model, long_start), repeat=1), ""),
        ("outlines 1.x (re-prompt strings)", best_of(lambda: chained_outlines(om, long_start), repeat=1), ""),
    ], "outlines 1.x (re-prompt strings)")

    system = "You are a helpful assistant who answers in one short sentence. " * 6
    questions = [f"Question {i}: name a fruit that is {c}." for i, c in
                 enumerate(["red", "yellow", "green", "orange", "purple"] * 4)]

    def shared_seqstate():
        model.store.clear()
        gen = ss.text(model)
        return [gen(system + q, max_tokens=8) for q in questions]

    def shared_outlines():
        return [om(system + q, max_new_tokens=8) for q in questions]

    def shared_batched():
        model.store.clear()
        return ss.text(model)([system + q for q in questions], max_tokens=8)

    report("20 calls sharing a system prompt, 8 tokens each", [
        ("seqstate (radix store)", best_of(shared_seqstate, repeat=1), "20 sequential calls"),
        ("seqstate, one batched call", best_of(shared_batched, repeat=1), "prefix prefilled once"),
        ("outlines 1.x", best_of(shared_outlines, repeat=1), "20 sequential calls"),
    ], "outlines 1.x")

    gen_json, gen_text = ss.json(model, Record), ss.text(model)
    gen_json("warm", max_tokens=4)
    prompt = "A film record as JSON: "

    def rate(gen):
        model.store.clear()
        t0 = time.perf_counter()
        s = gen(prompt, max_tokens=96)
        n = len(s.token_ids[0][0]) - len(model.encode(prompt))
        return (time.perf_counter() - t0) / n, n

    free, n_free = min(rate(gen_text) for _ in range(2))
    cons, n_cons = min(rate(gen_json) for _ in range(2))
    report("decode speed per token", [
        ("unconstrained", free, f"{1 / free:.1f} tok/s ({n_free} tok)"),
        ("JSON schema", cons, f"{1 / cons:.1f} tok/s ({n_cons} tok)"),
    ], "unconstrained")
