"""Constraint-guided speculation: JSON with and without it, and vs free text.

A pydantic model with six descriptively named fields on the default model: wall time of the
same greedy call with ``speculate=True`` and ``False`` (the output is identical), and
constrained tokens/s against free-text tokens/s for the same number of tokens, on each engine.
"""

from __future__ import annotations

from pydantic import BaseModel

import seqstate as ss
from benchmarks.harness import interleaved, report

PROMPT = "Invent a customer record for an online bookshop as JSON:\n"


class Customer(BaseModel):
    customer_full_name: str
    customer_email_address: str
    customer_age_in_years: int
    preferred_contact_method: str
    is_premium_subscriber: bool
    account_creation_year: int


def engine_rows(model, label: str) -> None:
    record = ss.json(model, Customer)
    text = ss.text(model)
    plain = record(PROMPT, speculate=False)
    fast = record(PROMPT)
    assert fast.token_ids == plain.token_ids, "speculation changed the greedy output"
    n = len(plain.token_ids[0][0]) - len(model.encode(PROMPT))
    before = model.stats
    record(PROMPT)
    used = model.stats - before
    t_plain, t_fast, t_free = interleaved([
        lambda: record(PROMPT, speculate=False), lambda: record(PROMPT),
        lambda: text(PROMPT, max_tokens=n, hooks=[_no_eos(model)])], repeat=3)
    report(f"JSON, 6 fields, {n} tokens ({label} engine)", [
        ("json, token by token", t_plain, f"{n / t_plain:.1f} tok/s"),
        ("json, speculation", t_fast,
         f"{n / t_fast:.1f} tok/s; {used.draft_tokens_accepted} drafted tokens accepted, "
         f"{used.draft_tokens_rejected} rejected, {used.forward_calls} forwards"),
        ("free text, same tokens", t_free, f"{n / t_free:.1f} tok/s"),
    ], "json, token by token")


def _no_eos(model):
    eos = tuple(model.eos_token_ids)
    return lambda e: ss.hooks.Resample(ban=eos) if e.token in eos else None


def main(model) -> None:
    engine_rows(model, "hf")
    try:
        fast = ss.models.default(engine="llama.cpp")
    except (ImportError, ss.ModelNotAvailable) as exc:
        print(f"  llama.cpp engine unavailable: {exc}")
        return
    engine_rows(fast, "llama.cpp")
