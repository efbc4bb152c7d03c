"""The demo program behind ``make demo``: each capability shows up here as it lands."""

from __future__ import annotations

import time

from pydantic import BaseModel

import seqstate as ss

__all__ = ["run"]


class Vehicle(BaseModel):
    name: str
    wheels: int


def _timed(label: str, fn):
    t0 = time.perf_counter()
    out = fn()
    print(f"  [{label}: {time.perf_counter() - t0:.2f} s]")
    return out


def run(model) -> None:
    """Print a chained program mixing generators, a fork and a JSON value on ``model``."""
    text = ss.text(model)
    yes_no = ss.choice(model, ["yes", "no"])
    vehicle = ss.json(model, Vehicle)

    s = _timed("text", lambda: text("Q: name three vehicles.\nA:", max_tokens=30, stop_at="\n"))
    print(f"text   -> {s.value!r}")
    before = model.stats
    s = _timed("choice", lambda: yes_no(s + "Is a bicycle one of them? Answer yes or no: "))
    d = model.stats - before
    print(f"choice -> {s.value!r}   (prefilled {d.prefill_tokens} new tokens, "
          f"reused {d.cached_tokens_reused} from the KV store)")
    s = _timed("json", lambda: vehicle(s + "\nA car as JSON: ", max_tokens=40))
    print(f"json   -> {s.value!r}")
    forks = _timed("fork x3", lambda: text(s + "\nOne more vehicle:", num_samples=3,
                                           sampler=ss.multinomial(0.8), seed=0, max_tokens=8))
    for i, v in enumerate(forks.value[0]):
        print(f"sample {i} -> {v!r}")
    print(f"state shape {forks.shape}; weights {[round(w, 2) for w in forks.weights[0].tolist()]}")
