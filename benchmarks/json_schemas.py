"""JSON schemas: JSONSchemaBench coverage, compile time, validity, decode speed."""

from __future__ import annotations

import collections
import json
import statistics
import time
from pathlib import Path

import seqstate as ss
from benchmarks.harness import best_of, report
from seqstate.constraints import compile as compiled

CORPUS = Path(__file__).resolve().parents[2] / "shared/data/jsonschemabench/schemas.jsonl"
FILM = {"type": "object", "required": ["title", "year", "genres", "summary"], "properties": {
    "title": {"type": "string"}, "year": {"type": "integer", "minimum": 1880},
    "genres": {"type": "array", "items": {"type": "string"}}, "summary": {"type": "string"}}}


def coverage(model, rows: list[dict]) -> dict[str, object]:
    """Compile every schema once (the time includes the first mask); print the table."""
    compiled.json_schema(model, {"type": "integer"}).start().allowed()      # tokenizer, once
    per = collections.defaultdict(lambda: [0, 0])
    times, cpu, errors, ok = [], [], collections.Counter(), {}
    for row in rows:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            compiled.json_schema(model, row["schema"]).start().allowed()
            ok.setdefault(row["category"], row)
            per[row["category"]][0] += 1
        except ss.ConstraintError as exc:
            errors[str(exc).split("(")[0].strip()] += 1
        per[row["category"]][1] += 1
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    times.sort()
    cpu.sort()
    print(f"\n== JSONSchemaBench sample ({len(rows)} schemas): coverage per category")
    print(f"  {'category':<16}{'compiled':>10}{'coverage':>10}")
    for category, (k, n) in sorted(per.items()):
        print(f"  {category:<16}{f'{k}/{n}':>10}{k / n:>10.0%}")
    k = sum(v[0] for v in per.values())
    print(f"  {'all':<16}{f'{k}/{len(rows)}':>10}{k / len(rows):>10.0%}")
    for name, values in (("wall", times), ("CPU", cpu)):
        print(f"  compile time ({name}): median {statistics.median(values) * 1e3:.1f} ms, "
              f"p90 {values[int(0.9 * len(values))] * 1e3:.1f} ms, max {values[-1] * 1e3:.1f} ms")
    for message, count in errors.most_common():
        print(f"  refused x{count}: {message}")
    return ok


def validity(model, rows: list[dict]) -> None:
    """Sample one compiled schema per category; every finished value must validate."""
    finished = flagged = unfinished = 0
    for i, row in enumerate(rows):
        gen = ss.json(model, row["schema"])
        prompt = f"A JSON value for this schema: {json.dumps(row['schema'])[:300]}\nJSON: "
        state = gen(prompt, max_tokens=160, num_samples=2, sampler=ss.multinomial(), seed=i)
        for text, reason in zip(state.texts[0], state.finish_reason[0]):
            if reason != "constraint_complete":
                unfinished += 1
            elif gen.constraint.validate(text[len(prompt):]) is None:
                finished += 1
            else:
                flagged += 1
    print(f"  validity on {model.name}, {len(rows)} schemas x 2 samples: {finished} finished and "
          f"valid, {flagged} flagged invalid by validation, {unfinished} hit max_tokens")


def speed(model, repeat: int = 5) -> None:
    """Constrained vs unconstrained greedy decode, in seconds per generated token.

    The two runs alternate, so both see the same load on a shared machine; the constraint's
    own work per token (mask, advance, completion check) is timed apart from the model.
    """
    prompt = "Describe the film Casablanca as JSON with title, year, genres and summary.\n"
    gens = {"unconstrained": ss.text(model), "ss.json(FILM)": ss.json(model, FILM)}
    n_prompt = len(model.encode(prompt))
    times: dict[str, list[float]] = {name: [] for name in gens}
    tokens: dict[str, int] = {}
    for i in range(repeat + 1):
        for name, gen in gens.items():
            t0 = time.perf_counter()
            state = gen(prompt, max_tokens=64)
            tokens[name] = len(state.token_ids[0][0]) - n_prompt
            if i:                                          # the first round warms up
                times[name].append((time.perf_counter() - t0) / tokens[name])
    json_ids = state.token_ids[0][0][n_prompt:]
    per = {name: statistics.median(ts) for name, ts in times.items()}
    report("JSON schema decode vs unconstrained (time per token; >= 0.9x wanted)", [
        (name, per[name], f"{tokens[name]} tokens, {1 / per[name]:.1f} tokens/s")
        for name in gens], "unconstrained")
    constraint = gens["ss.json(FILM)"].constraint

    def walk() -> None:
        cursor = constraint.start()
        for token in json_ids:
            cursor.allowed()
            cursor = cursor.advance(token)
            _ = cursor.complete

    print(f"  constraint work per token: {best_of(walk) / len(json_ids) * 1e6:.0f} us")


def main(model) -> None:
    if not CORPUS.exists():
        print(f"\n== JSON schemas: {CORPUS} is missing; corpus sections skipped")
    else:
        with CORPUS.open() as f:
            rows = [json.loads(line) for line in f]
        validity(model, list(coverage(model, rows).values()))
    speed(model)
