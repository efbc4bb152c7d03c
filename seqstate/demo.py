"""The demo program behind ``make demo``: a conversation that forks, slices back, beam-searches
and speaks JSON, each step saying what seqstate saved."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

import seqstate as ss

__all__ = ["run"]


class Vehicle(BaseModel):
    name: str
    wheels: int = Field(ge=1, le=18)
    top_speed_kmh: int = Field(ge=1, le=500)


class _Step:
    """Times one step and measures the model's work counters across it."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self) -> _Step:
        self.t0, self.before = time.perf_counter(), self.model.stats
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.used = self.model.stats - self.before


def _show(label: str, value: str, step: _Step, saved: str) -> None:
    print(f"{label:<8} {value}")
    print(f"{'':<8} [{step.seconds:.2f} s; {saved}]")


def run(model) -> None:
    """Print a short program on ``model`` with what each step reused or avoided."""
    text = ss.text(model)
    total = model.stats

    with _Step(model) as st:
        chat = ss.chat(model).system("You are terse.").user("Name three vehicles.")
        s = chat.assistant(text, max_tokens=24, name="vehicles")
    _show("chat", repr(s["vehicles"]), st,
          f"prompt rendered by the tokenizer's chat template, "
          f"{st.used.prefill_tokens} tokens prefilled")

    with _Step(model) as st:
        s = s.user("Is a bicycle one of them?").assistant(
            ss.choice(model, ["yes", "no"]), name="bicycle")
    _show("turn 2", repr(s["bicycle"]), st,
          f"{st.used.cached_tokens_reused} tokens of conversation reused, only "
          f"{st.used.prefill_tokens} new ones prefilled")

    with _Step(model) as st:
        ask = s.user("Name one more vehicle.")
        more = ask.assistant(text, num_samples=3, sampler=ss.multinomial(0.8), seed=0,
                             max_tokens=8, name="more")
    shared = len(ask.token_ids[0][0])
    _show("fork x3", repr(more["more"][0]), st,
          f"3 samples share one stored {shared}-token prefix: {2 * shared} tokens of "
          f"prefill avoided")

    with _Step(model) as st:
        first = more.samples[0]
        back = first.tokens[:-3]
        redo = text(back, max_tokens=6, stop_at="\n")
    _show("slice", f"{first['more']!r} -> cut 3 tokens -> {redo.value!r}", st,
          f"KV kept through the cut: {st.used.prefill_tokens} tokens prefilled, "
          f"{st.used.cached_tokens_reused} reused")

    with _Step(model) as st:
        beam = ss.beam_search(2)
        idea = ss.chat(model).user("Suggest a name for a new bakery.").assistant(
            text, sampler=beam, max_tokens=10, stop_at="\n", name="name")
        rated = ss.regex(model, r"[1-9]|10")(idea + "\nRating out of 10: ",
                                             sampler=beam, name="rating")
    paths = [f"{rated.samples[k]['name']!r} rated {rated.samples[k]['rating']}"
             for k in range(rated.samples)]
    _show("beam", "; ".join(paths), st,
          "beams ranked by both calls' log-probs together; forks share their prefixes")

    with _Step(model) as st:
        car = s.user("Describe a car as JSON.").assistant(
            ss.json(model, Vehicle), max_tokens=80, name="car")
    _show("json", repr(car["car"]), st,
          f"{st.used.draft_tokens_accepted} forced tokens (keys, punctuation) verified "
          f"in chunks: {st.used.forward_calls} forwards for "
          f"{st.used.decode_tokens} tokens")

    used = model.stats - total
    print(f"overall  {used.cached_tokens_reused} tokens reused from the KV store, "
          f"{used.prefill_tokens} prefilled, {used.decode_tokens} decoded")
