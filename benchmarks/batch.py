"""Many programs at once: run_batch vs the same programs one after another.

16 instances of a 3-call chained program (free text, a choice, a regex; ~20 tokens per call)
on each engine, and outlines 1.x running the same program over the same inputs (it has no
cross-call batching).
"""

from __future__ import annotations

import time

import seqstate as ss
from benchmarks.harness import report

TOPICS = ["rain", "cats", "tea", "maps", "bees", "jazz", "salt", "wind",
          "snow", "owls", "rice", "boats", "clay", "moss", "kites", "figs"]
TOKENS = 20


def program(model):
    text = ss.text(model)
    verdict = ss.choice(model, ["useful", "useless", "unclear"])
    score = ss.regex(model, r"[0-9]{1,2}(\.[0-9])?")

    def one(topic: str):
        s = text(f"Write two sentences about {topic}.\n", max_tokens=TOKENS)
        s = verdict(s + "\nIs this text useful? Answer:")
        s = score(s + "\nScore out of 10:")
        return s.value
    return one


def outlines_program(om):
    from typing import Literal

    import outlines

    verdict = outlines.Generator(om, Literal["useful", "useless", "unclear"])
    score = outlines.Generator(om, outlines.types.Regex(r"[0-9]{1,2}(\.[0-9])?"))

    def one(topic: str):
        p = f"Write two sentences about {topic}.\n"
        p += om(p, max_new_tokens=TOKENS)
        p += "\nIs this text useful? Answer:"
        p += verdict(p)
        p += "\nScore out of 10:"
        return score(p)
    return one


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def engine_rows(model, label: str) -> list[tuple[str, float, str]]:
    one = program(model)
    one(TOPICS[0])                                          # warm caches and compiled masks
    model.store.clear()
    seq = timed(lambda: [one(t) for t in TOPICS])
    model.store.clear()
    before = model.stats
    par = timed(lambda: ss.run_batch(one, TOPICS, concurrency=16, progress=False))
    used = model.stats - before
    note = f"{used.decode_tokens / max(used.forward_calls, 1):.1f} rows per forward"
    return [(f"{label}: one after another", seq, ""),
            (f"{label}: run_batch(16)", par, note)]


def main(model) -> None:
    rows = engine_rows(model, "hf")
    try:
        import outlines

        om = outlines.from_transformers(model.hf_model, model.hf_tokenizer)
        one = outlines_program(om)
        one(TOPICS[0])
        rows.append(("outlines 1.x: one after another", timed(lambda: [one(t) for t in TOPICS]), ""))
    except Exception as exc:                              # report, do not hide, a peer that fails
        print(f"  outlines unavailable: {type(exc).__name__}: {exc}")
    report(f"16 programs x 3 calls (~{TOKENS} tokens per call), hf engine", rows,
           "hf: one after another")
    try:
        fast = ss.models.default(engine="llama.cpp")
    except ss.ModelNotAvailable as exc:
        print(f"  llama.cpp engine unavailable: {exc}")
        return
    report("the same on the llama.cpp engine", engine_rows(fast, "llama.cpp"),
           "llama.cpp: one after another")
