"""JSONSchemaBench: coverage, compile time and the validity of every finished value.

The corpus (300 real schemas, 30 per category) lives beside the checkout in
``../shared/data/jsonschemabench``.  The normal run compiles and samples one schema per
category; ``pytest -m slow tests/test_json_corpus.py`` sweeps all 300 and prints the table.
"""

import collections
import json
import statistics
import time
from pathlib import Path

import jsonschema
import pytest
import torch

import seqstate as ss
from seqstate.constraints import compile as compiled
from seqstate.constraints.json_constraint import validator_for

CORPUS = Path(__file__).resolve().parents[2] / "shared/data/jsonschemabench/schemas.jsonl"
PROMPT = "JSON: "

pytestmark = pytest.mark.skipif(not CORPUS.exists(), reason=f"{CORPUS} is not there")


def load() -> list[dict]:
    with CORPUS.open() as f:
        return [json.loads(line) for line in f]


def compile_all(model, rows: list[dict]) -> list[tuple[dict, object, float]]:
    """``(row, constraint or ConstraintError, seconds)``; the time includes the first mask.

    Seconds of CPU, not wall time: this machine is shared, and a test must not fail because
    another process held the cores.  On an idle machine the two agree.
    """
    compiled.json_schema(model, {"type": "integer"}).start().allowed()      # tokenizer, once
    out = []
    for row in rows:
        t0 = time.process_time()
        try:
            constraint = compiled.json_schema(model, row["schema"])
            constraint.start().allowed()
        except ss.ConstraintError as exc:
            constraint = exc
        out.append((row, constraint, time.process_time() - t0))
    return out


def table(results: list[tuple[dict, object, float]]) -> str:
    """The per-category coverage table, with the compile-time median and p90."""
    per = collections.defaultdict(lambda: [0, 0])
    for row, constraint, _ in results:
        per[row["category"]][0] += not isinstance(constraint, Exception)
        per[row["category"]][1] += 1
    lines = [f"{'category':<16}{'compiled':>10}{'coverage':>10}"]
    lines += [f"{c:<16}{f'{k}/{n}':>10}{k / n:>10.0%}" for c, (k, n) in sorted(per.items())]
    k, n = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    times = sorted(t for _, _, t in results)
    lines.append(f"{'all':<16}{f'{k}/{n}':>10}{k / n:>10.0%}   compile (CPU) median "
                 f"{statistics.median(times) * 1e3:.1f} ms, p90 {p90(times) * 1e3:.1f} ms")
    return "\n".join(lines)


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * len(values))]


def sample_and_check(model, row: dict, *, samples: int, max_tokens: int,
                     seed: int) -> tuple[int, int]:
    """Sample ``row``'s schema; every finished value must be valid.  ``(finished, flagged)``.

    A finished value is checked twice: by the constraint's own validation and by ``jsonschema``
    with its stock format checker.  A value that fails the first is never returned (value None:
    "flagged", reported as finish_reason "invalid" by the generator).
    """
    gen = ss.json(model, row["schema"])                 # compiled already: from the model's cache
    constraint = gen.constraint
    state = gen(PROMPT, max_tokens=max_tokens, sampler=ss.multinomial(temperature=1.5),
                seed=seed, num_samples=samples)
    cls = validator_for(row["schema"])
    stock = cls(row["schema"], format_checker=jsonschema.FormatChecker())
    finished = flagged = 0
    for text, reason, value in zip(state.texts[0], state.finish_reason[0], state.value[0]):
        if reason not in ("constraint_complete", "invalid"):
            continue
        text = text[len(PROMPT):]
        error = constraint.validate(text)
        if error is not None:
            assert value is None, (row["id"], text, error)
            flagged += 1
            continue
        finished += 1
        assert reason == "constraint_complete"
        assert value == json.loads(text)
        errors = list(stock.iter_errors(json.loads(text)))
        assert not errors, (row["id"], text, errors[0].message)
    return finished, flagged


def first_per_category(rows: list[dict]) -> list[dict]:
    seen: dict[str, dict] = {}
    for row in rows:
        seen.setdefault(row["category"], row)
    return list(seen.values())


@pytest.fixture
def one_thread():
    """Many short decode steps of a tiny model: one torch thread avoids thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_schema_per_category_compiles_fast_and_generates_valid_values(tiny, one_thread):
    results = compile_all(tiny, first_per_category(load()))
    assert sum(not isinstance(c, Exception) for _, c, _ in results) >= 9
    finished = 0
    for i, (row, constraint, _) in enumerate(results):
        if not isinstance(constraint, Exception):
            finished += sample_and_check(tiny, row, samples=2, max_tokens=100, seed=i)[0]
    assert finished >= 3


@pytest.mark.slow
def test_full_corpus(fresh_tiny, one_thread):
    results = compile_all(fresh_tiny, load())
    print("\n" + table(results))
    ok = [row for row, c, _ in results if not isinstance(c, Exception)]
    assert len(ok) >= 0.9 * len(results)
    assert p90([t for _, _, t in results]) <= 0.050
    finished = flagged = 0
    for i, row in enumerate(ok):
        f, b = sample_and_check(fresh_tiny, row, samples=4, max_tokens=200, seed=i)
        finished, flagged = finished + f, flagged + b
    print(f"sampled {len(ok)} schemas x 4: {finished} finished values, all valid; "
          f"{flagged} flagged invalid by validation")
    assert finished >= len(ok)
