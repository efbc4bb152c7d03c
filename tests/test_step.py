"""The step API reproduces the engine's output when fed the same logits."""

import random

import pytest
import torch

import seqstate as ss
from seqstate.constraints.grammar import GrammarCursor
from seqstate.constraints.healing import HealingCursor
from seqstate.detokenize import StopMatcher
from seqstate.engine import RowRequest, Stepper, generate
from seqstate.engine.rows import LiveRow
from seqstate.engine.step import allowed_mask, allowed_masks


def drive(model, stepper):
    while not stepper.done:
        logits = torch.stack([model.full_logits(stepper.tokens(i))[-1] for i in stepper.live])
        stepper.step(logits)
    return stepper.results()


def test_stepper_reproduces_engine(tiny):
    c = ss.constraints.regex(tiny, r"[a-z ]{3,12}\.")
    reqs = [RowRequest(tuple(tiny.encode("Say:")), 16, c.start()),
            RowRequest(tuple(tiny.encode("Other")), 10, None, StopMatcher(["e"]))]
    ours = generate(tiny, reqs, ss.greedy())
    theirs = drive(tiny, Stepper(tiny, reqs))
    for a, b in zip(ours, theirs):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason and a.text == b.text


def test_stepper_with_hooks_and_sampling(tiny):
    reqs = [RowRequest(tuple(tiny.encode("A")), 8)]
    hook = ss.hooks.ban_phrases(["e"])
    ours = generate(tiny, reqs, ss.multinomial(), torch.Generator().manual_seed(3), [hook])
    theirs = drive(tiny, Stepper(tiny, reqs, ss.multinomial(), torch.Generator().manual_seed(3), [hook]))
    assert ours[0].tokens == theirs[0].tokens


def test_stepper_rejects_bad_logits(tiny):
    st = Stepper(tiny, [tiny.encode("x")])
    with pytest.raises(ValueError, match="NaN"):
        st.step(torch.full((1, tiny.vocab.size), float("nan")))
    with pytest.raises(ValueError, match="1 live rows"):
        st.step(torch.zeros(2, tiny.vocab.size))


def _walk(cursor, rng: random.Random, steps: int) -> list:
    """``cursor`` and the cursors after each of up to ``steps`` random allowed tokens."""
    out = [cursor]
    for _ in range(steps):
        allowed = cursor.allowed().clone()
        allowed[list(cursor.compiled().eos)] = False
        ids = allowed.nonzero().flatten().tolist()
        if not ids:
            break
        cursor = cursor.advance(rng.choice(ids))
        out.append(cursor)
    return out


def test_batched_masks_equal_per_row_masks(tiny):
    # the step's (B, V) masks against each row's own `allowed_mask` on many states: regex,
    # JSON and Lark cursors along random walks, healing cursors, unconstrained rows, bans
    rng = random.Random(0)
    starts = [ss.constraints.regex(tiny, r"[a-z ]{1,20}\.(yes|no)"),
              ss.constraints.json_schema(tiny, {"type": "object", "properties": {
                  "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}),
              ss.constraints.cfg(tiny, ss.grammars.load("arithmetic"))]
    cursors = [c for s in starts for _ in range(4) for c in _walk(s.start(), rng, 12)]
    cursors += [HealingCursor(tiny.vocab, b" wor"), HealingCursor(tiny.vocab, b"x"), None, None]
    rng.shuffle(cursors)
    rows = []
    for k, cursor in enumerate(cursors):
        row = LiveRow(RowRequest(tuple(tiny.encode("Hi")), 8, cursor), tiny.vocab, tiny.eos_token_ids)
        if k % 5 == 0:
            row.bans[len(row.tokens)] = {rng.randrange(tiny.vocab.size) for _ in range(3)}
        rows.append(row)
    # fresh cursors everywhere (no mask computed yet), so the batch fills llguidance's masks
    # in parallel; the per-row reference computes each of its copies alone
    fresh = [LiveRow(r.req, r.vocab, r.eos) for r in rows]
    for a, b in zip(fresh, rows):
        a.bans = b.bans
        a.cursor = (type(b.cursor)(b.cursor.constraint, b.cursor.matcher.deep_copy())
                    if isinstance(b.cursor, GrammarCursor) else b.cursor)
    for width in (tiny.vocab.size, tiny.vocab.size + 7):     # logits may be wider than V
        want = torch.stack([m if m is not None else torch.ones(width, dtype=torch.bool)
                            for m in (allowed_mask(r, width) for r in rows)])
        got = allowed_masks(fresh, width, torch.device("cpu"))
        assert got.shape == want.shape and torch.equal(got, want)
    free = LiveRow(RowRequest(tuple(tiny.encode("Hi")), 8), tiny.vocab, tiny.eos_token_ids)
    assert allowed_masks([free, free], tiny.vocab.size, torch.device("cpu")) is None
