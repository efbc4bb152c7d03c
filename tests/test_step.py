"""The step API reproduces the engine's output when fed the same logits."""

import math
import random
from unittest import mock


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqstate as ss
from seqstate.constraints.grammar import GrammarCursor
from seqstate.constraints.healing import HealingCursor
from seqstate.detokenize import StopMatcher
from seqstate.engine import Decoding, RowRequest, Stepper, generate
from seqstate.engine import step as step_module
from seqstate.engine.masks import allowed_mask, allowed_masks, constrained, packed_masks
from seqstate.engine.rows import LiveRow
from seqstate.engine.buffers import StepBuffers
from seqstate.engine.logits import greedy_list, picked_values
from seqstate.sampling.functions import greedy_tokens


def drive(model, stepper):
    while not stepper.done:
        logits = torch.stack([model.full_logits(stepper.tokens(i))[-1] for i in stepper.live])
        stepper.step(logits)
    return stepper.results()


def test_stepper_reproduces_engine(tiny):
    c = ss.constraints.regex(tiny, r"[a-z ]{3,12}\.")
    reqs = [RowRequest(tuple(tiny.encode("Say:")), 16, c.start()),
            RowRequest(tuple(tiny.encode("Other")), 10, None, StopMatcher(["e"]))]
    ours = generate(tiny, reqs)
    theirs = drive(tiny, Stepper(tiny, reqs))
    for a, b in zip(ours, theirs):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason and a.text == b.text


def test_stepper_with_hooks_and_sampling(tiny):
    reqs = [RowRequest(tuple(tiny.encode("A")), 8)]
    hook = ss.hooks.ban_phrases(["e"])
    ours = generate(tiny, reqs, Decoding(ss.multinomial(), torch.Generator().manual_seed(3), [hook]))
    theirs = drive(tiny, Stepper(tiny, reqs, Decoding(ss.multinomial(),
                                                      torch.Generator().manual_seed(3), [hook])))
    assert ours[0].tokens == theirs[0].tokens


def test_stepper_rejects_bad_logits(tiny):
    st = Stepper(tiny, [tiny.encode("x")])
    with pytest.raises(ValueError, match="NaN"):
        st.step(torch.full((1, tiny.vocab.size), float("nan")))
    with pytest.raises(ValueError, match="1 live rows"):
        st.step(torch.zeros(2, tiny.vocab.size))


def test_a_stepper_takes_requests_or_rows_one_of_them(tiny):
    row = LiveRow(RowRequest(tuple(tiny.encode("Hi")), 8), tiny.vocab, tiny.eos_token_ids)
    for args, says in (({}, "neither"), ({"requests": [[1, 2]], "rows": [row]}, "both")):
        with pytest.raises(ss.ArgumentError, match=f"one of them; it was given {says}"):
            Stepper(tiny, **args)
    assert Stepper(tiny, rows=[row]).rows == [row]


class _Kept(StepBuffers):
    """Buffers that remember the names a step asked them for."""

    def __init__(self):
        super().__init__()
        self.names = []

    def tensor(self, name, like, rows=None):
        self.names.append(name)
        return super().tensor(name, like, rows)


def _digits(model):
    return [RowRequest(tuple(model.encode("N:")), 4, ss.constraints.regex(model, "[0-9]+").start())]


def test_a_step_writes_into_the_buffers_it_is_handed_else_its_own(tiny):
    logits = torch.randn(1, tiny.vocab.size, generator=torch.Generator().manual_seed(0))
    sampled = Decoding(ss.multinomial(), torch.Generator().manual_seed(0))
    handed, stepper = _Kept(), Stepper(tiny, _digits(tiny), sampled)
    stepper._own = _Kept()
    stepper.step(logits, buffers=handed)
    assert handed.names == ["masked"] and stepper._own.names == []
    stepper.step(logits)
    assert handed.names == ["masked"] and stepper._own.names == ["masked"]


def test_a_run_hands_its_buffers_to_its_jobs_steps(fresh_tiny):
    """The scheduler's run owns the tensors its jobs' steps write (no thread's state)."""
    from seqstate.engine.decode import DecodeJob
    from seqstate.engine.running import _Run

    job = DecodeJob(fresh_tiny, _digits(fresh_tiny),
                    Decoding(ss.multinomial(), torch.Generator().manual_seed(0)))
    run = _Run(fresh_tiny.backend)
    run.buffers, run.waiting = _Kept(), [job]
    try:
        with torch.inference_mode():
            while run.jobs:
                run.step()
    finally:
        run.close()
    assert job.outbox.get()[0] == "done" and "masked" in run.buffers.names


def test_greedy_step_with_infinities_matches_argmax_and_log_softmax(tiny):
    """A greedy step reads each row's finiteness off its best logit: rows holding -inf
    take their argmax, a row holding +inf its +inf token (its log-prob NaN, as the
    log-softmax says), and a row with no finite logit is refused."""
    v = tiny.vocab.size
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(0))
    logits[0, ::3] = float("-inf")
    logits[1, 17] = float("inf")
    rows = [LiveRow(RowRequest(tuple(tiny.encode("Hi")), 8), tiny.vocab, tiny.eos_token_ids)
            for _ in range(3)]
    Stepper(tiny, rows=rows).step(logits)
    want = logits.argmax(-1).tolist()
    logprobs = logits.log_softmax(-1)
    assert [r.tokens[-1] for r in rows] == want and want[1] == 17
    assert rows[0].logprobs == pytest.approx([logprobs[0, want[0]].item()], abs=1e-5)
    assert rows[2].logprobs == pytest.approx([logprobs[2, want[2]].item()], abs=1e-5)
    assert math.isnan(rows[1].logprobs[0])
    for bad in (float("-inf"), float("nan")):
        logits[2] = bad
        with pytest.raises(ss.LogitsError, match="NaN/inf"):
            Stepper(tiny, rows=[_twin(r) for r in rows]).step(logits)


@pytest.mark.parametrize("sampler", [ss.greedy(), ss.multinomial(temperature=1.0)])
def test_log_probs_are_the_log_softmax(tiny, sampler):
    """A token's log-prob is its logit less its row's logsumexp: its row's log-softmax there,
    to float32 noise, step after step, masked rows and hooks' replacements included."""
    v, n = tiny.vocab.size, 23
    regex = ss.constraints.regex(tiny, r"[a-z ]{2,40}")
    reqs = [RowRequest(tuple(tiny.encode("Hi")), 8, regex.start() if j % 3 == 0 else None)
            for j in range(n)]
    replace = lambda e: ss.hooks.Replace(260) if e.row == 1 and e.position == 3 else None
    for hooks in ((), (replace,)):
        stepper = Stepper(tiny, reqs, Decoding(sampler, torch.Generator().manual_seed(1), hooks))
        gen = torch.Generator().manual_seed(0)
        for k in range(3):
            logits = torch.randn(n, v, generator=gen) * 4
            stepper.step(logits)
            want = logits.log_softmax(-1)
            got = [r.logprobs[k] for r in stepper.rows]
            assert got == pytest.approx([want[j, r.tokens[-1]].item()
                                         for j, r in enumerate(stepper.rows)], abs=1e-4)


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


def _fresh(cursor):
    """``cursor`` as it was before anything asked for its mask (llguidance's caches it)."""
    if isinstance(cursor, GrammarCursor):
        return GrammarCursor(cursor.constraint, cursor.matcher.deep_copy())
    return cursor


def _twin(row: LiveRow) -> LiveRow:
    """A row like ``row`` (its request and bans) whose cursor has no mask computed yet."""
    twin = LiveRow(row.req, row.vocab, row.eos)
    twin.bans, twin.cursor = row.bans, _fresh(row.cursor)
    return twin


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
    fresh = [_twin(r) for r in rows]
    for width in (tiny.vocab.size, tiny.vocab.size + 7):     # logits may be wider than V
        want = torch.stack([m if m is not None else torch.ones(width, dtype=torch.bool)
                            for m in (allowed_mask(r, width) for r in rows)])
        got = allowed_masks(fresh, width, torch.device("cpu"))
        assert got.shape == want.shape and torch.equal(got, want)
    free = LiveRow(RowRequest(tuple(tiny.encode("Hi")), 8), tiny.vocab, tiny.eos_token_ids)
    assert allowed_masks([free, free], tiny.vocab.size, torch.device("cpu")) is None


# logits with ties (few distinct values), NaN and +-inf: the fast paths must pick what the
# plain torch operations pick
_VALUES = st.sampled_from([0.0, 1.0, 2.5, -3.0, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(4000, 9000), st.integers(0, 2**31 - 1),
       st.lists(st.tuples(st.integers(0, 10**6), _VALUES), max_size=6), st.booleans())
def test_greedy_tokens_is_argmax(rows, vocab, seed, spikes, ties):
    """The CPU's greedy (NumPy's argmax) picks torch's argmax index, first on ties, NaN as
    argmax ranks it, in every float dtype and layout (`greedy_list` too), and
    `picked_values` gives the values at any index."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, 3, (rows, vocab), generator=g).float() if ties
              else torch.randn(rows, vocab, generator=g))
    for at, value in spikes:
        logits.view(-1)[at % logits.numel()] = value
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for x in (logits.to(dtype), logits[:, :-3].to(dtype), logits.to(dtype).T.contiguous().T):
            best = x.argmax(dim=-1)
            assert torch.equal(greedy_tokens(x), best)
            assert greedy_list(x) == best.tolist()
            other = torch.randint(0, x.shape[1], (rows,), generator=g)
            torch.testing.assert_close(
                torch.tensor(picked_values(x, other.tolist()), dtype=torch.float64),
                x.gather(1, other[:, None]).squeeze(1).double(), rtol=0, atol=0, equal_nan=True)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 300), st.integers(0, 2**31 - 1), st.floats(0, 1),
       st.lists(st.tuples(st.integers(0, 10**4), _VALUES), max_size=4))
def test_constrained_is_where(rows, vocab, seed, density, spikes):
    """Masking by a +-inf bias equals torch.where on finite logits; with NaN or inf present
    the step passes finite=False and gets torch.where itself."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 30
    allowed = torch.rand(rows, vocab, generator=g) < density
    expected = torch.where(allowed, logits, float("-inf"))
    assert torch.equal(constrained(logits, allowed, finite=True), expected)
    out = torch.empty(rows + 2, vocab)[:rows]
    assert torch.equal(constrained(logits, allowed, True, out), expected)
    for at, value in spikes:
        logits.view(-1)[at % logits.numel()] = value
    expected = torch.where(allowed, logits, float("-inf"))
    assert torch.allclose(constrained(logits, allowed, finite=False), expected, rtol=0, atol=0,
                          equal_nan=True)


@pytest.fixture(scope="module")
def walked(tiny):
    """Cursors of every kind along random walks: regex (EOS where final), JSON (forced
    bytes where a key, a const or an enum's shared start comes next) and Lark grammars,
    token healing."""
    rng = random.Random(1)
    starts = [ss.constraints.regex(tiny, r"[a-z ]{1,20}\.(yes|no)"),
              ss.constraints.json_schema(tiny, {"type": "object", "properties": {
                  "name": {"type": "string"}, "n": {"type": "integer"},
                  "b": {"const": "hello world"}, "tags": {"enum": ["alpha beta", "alpha gamma"]}},
                  "required": ["name", "n", "b", "tags"]}),
              ss.constraints.cfg(tiny, ss.grammars.load("arithmetic"))]
    cursors = [c for s in starts for c in _walk(s.start(), rng, 14)[::2]]
    return cursors + [HealingCursor(tiny.vocab, b" wor"), HealingCursor(tiny.vocab, b"x")]


def test_allows_is_the_mask_for_every_token(tiny, walked):
    """`Cursor.allows` answers what `allowed()` says of every id (past the vocabulary too),
    whether the cursor built its mask yet or not."""
    rng = random.Random(0)
    size = tiny.vocab.size
    for cursor in walked:
        mask = _fresh(cursor).allowed()
        allowed = set(mask.nonzero().flatten().tolist())
        # the rarer side whole (a string's refused quotes, a key's few starts), a sample of
        # the rest, EOS and ids past the vocabulary
        rare = allowed if len(allowed) < size / 2 else set(range(size)) - allowed
        ids = sorted(rare | set(rng.sample(range(size), 1500)) | set(tiny.eos_token_ids)
                     | {size, size + 2})
        fresh = _fresh(cursor)
        wrong = [t for t in ids if fresh.allows(t) != (t in allowed)]
        assert not wrong, (cursor, wrong[:5])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([3, 10**6]), st.floats(0, 1))
def test_greedy_step_is_the_masked_argmax(tiny, walked, seed, levels, spiked):
    """A greedy step checks each row's best token and masks only the rows that refuse it:
    the tokens are the argmax of every row's masked logits (ties to the first id), dead ends
    end their rows, and a row that allows its best token is never masked."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cursors = rng.sample(walked, 8) + [None, None]
    rows = []
    for k, cursor in enumerate(cursors):
        row = LiveRow(RowRequest(tuple(tiny.encode("Hi")), 64, _fresh(cursor)), tiny.vocab,
                      tiny.eos_token_ids)
        if k % 4 == 3:
            row.bans[len(row.tokens)] = {rng.randrange(tiny.vocab.size) for _ in range(3)}
        rows.append(row)
    reference = [_twin(r) for r in rows]
    masks = allowed_masks(reference, tiny.vocab.size, torch.device("cpu"))
    logits = torch.randint(0, levels, (len(rows), tiny.vocab.size), generator=g).float()
    for j in range(len(rows)):                   # some rows' best token allowed, some not
        if rng.random() < spiked:
            logits[j, rng.choice(masks[j].nonzero().flatten().tolist() or [0])] = levels
    expected = torch.where(masks, logits, float("-inf")).argmax(-1).tolist()
    dead = (~masks.any(-1)).tolist()
    best = logits.argmax(-1).tolist()
    before = [row.cursor for row in rows]
    stepper = Stepper(tiny, rows=rows)
    masked = []                                  # the rows the step built masks for

    def spied(some, *args):
        masked.extend(some)
        return packed_masks(some, *args)

    with mock.patch.object(step_module, "packed_masks", spied):
        events = {ev.row: ev for ev in stepper.step(logits)}
    for j, row in enumerate(rows):
        if not dead[j] and best[j] == expected[j] and masks[j, best[j]]:
            assert not any(r is row for r in masked)        # its best token was allowed
        if dead[j]:
            assert row.finish_reason == ss.FinishReason.DEAD_END
        elif expected[j] in tiny.eos_token_ids:
            assert events[j].token is None and row.done
        else:
            assert events[j].token == expected[j] and row.tokens[-1] == expected[j]
