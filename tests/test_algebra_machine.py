"""A Hypothesis state machine over the whole algebra, checked against plain token lists.

Each rule applies one operation (generate, slice, concatenate, fork, resume, beam) and compares
the result with a pure-Python reference of token lists; after every step the KV of the newest
state must equal a fresh forward.
"""

import re

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import seqstate as ss
from seqstate.engine import next_logprobs
from conftest import assert_close

MODEL = {}


def model():
    if "tiny" not in MODEL:
        MODEL["tiny"] = ss.models.testing.tiny(seed=3)
    return MODEL["tiny"]


WORDS = st.text(alphabet="abcdefghij ,.", min_size=1, max_size=12)


class Algebra(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = model()
        self.text = ss.text(self.m)
        self.digits = ss.regex(self.m, r"[0-9]{4}")
        self.states = []            # (state, reference rows: list of token lists, batch-major)

    def add(self, state, ref):
        assert [list(r.tokens) for r in state.rows] == ref
        self.states.append((state, ref))

    def pick(self, i):
        return self.states[i % len(self.states)]

    @initialize(texts=st.lists(WORDS, min_size=1, max_size=2))
    def start(self, texts):
        ids = [self.m.encode(t) or [1] for t in texts]
        self.add(ss.from_tokens(self.m, ids), ids)

    @rule(i=st.integers(0, 99), k=st.integers(1, 3))
    def generate(self, i, k):
        s, ref = self.pick(i)
        out = self.text(s, max_tokens=k)
        rows = [list(r.tokens) for r in out.rows]
        assert out.shape == s.shape
        assert all(new[: len(old)] == old for new, old in zip(rows, ref))
        if s.shape == (1, 1):                    # greedy continuation == fresh prompt continued
            assert self.text(ss.from_tokens(self.m, ref), max_tokens=k) == out
        self.add(out, rows)

    @rule(i=st.integers(0, 99), cut=st.integers(1, 6))
    def slice_back(self, i, cut):
        s, ref = self.pick(i)
        out = s[..., :-cut] if min(len(r) for r in ref) > cut else s[..., :1]
        expect = [r[:-cut] if min(len(x) for x in ref) > cut else r[:1] for r in ref]
        self.add(out, expect)

    @rule(i=st.integers(0, 99), text=WORDS)
    def append_text(self, i, text):
        s, ref = self.pick(i)
        self.add(s + text, [r + self.m.encode(text) for r in ref])

    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def concat(self, i, j):
        (a, ra), (b, rb) = self.pick(i), self.pick(j)
        try:
            out = a + b
        except ss.BatchMismatch:
            assert a.batch != b.batch and 1 not in (a.batch, b.batch) or (
                a.samples != b.samples and 1 not in (a.samples, b.samples))
            return
        expect = [ra[(bi % a.batch) * a.samples + si % a.samples] + rb[(bi % b.batch) * b.samples + si % b.samples]
                  for bi in range(out.batch) for si in range(out.samples)]
        self.add(out, expect)

    @precondition(lambda self: any(s.samples == 1 for s, _ in self.states))
    @rule(i=st.integers(0, 99), seed=st.integers(0, 5))
    def fork(self, i, seed):
        s, ref = next((x for x in self.states[i % len(self.states):] + self.states if x[0].samples == 1))
        parent = [list(r) for r in ref]
        out = self.text(s, num_samples=2, sampler=ss.multinomial(), seed=seed, max_tokens=2)
        assert out.shape == (s.batch, 2) and [list(r.tokens) for r in s.rows] == parent
        rows = [list(r.tokens) for r in out.rows]
        assert all(rows[b * 2 + k][: len(parent[b])] == parent[b] for b in range(s.batch) for k in range(2))
        self.add(out, rows)

    @rule(i=st.integers(0, 99), back=st.integers(1, 3))
    def resume(self, i, back):
        s, _ = self.pick(i)
        full = self.digits(s)
        cut = full[..., :-back]
        again = self.digits.resume(cut)
        for v, reason in zip(sum(again.value, []) if isinstance(again.value, list) else [again.value],
                             sum(again.finish_reason, []) if isinstance(again.finish_reason, list)
                             else [again.finish_reason]):
            if reason == "constraint_complete":
                assert re.fullmatch(r"[0-9]{4}", v)
        self.add(again, [list(r.tokens) for r in again.rows])

    @rule(i=st.integers(0, 99))
    def beam(self, i):
        s, ref = self.pick(i)
        out = self.text(s[:, :1, :], max_tokens=2, sampler=ss.beam_search(2))
        assert out.batch == s.batch and 1 <= out.samples <= 2
        w = out.weights
        assert (w[:, :-1] >= w[:, 1:]).all()
        self.add(out, [list(r.tokens) for r in out.rows])

    @invariant()
    def newest_kv_is_exact(self):
        if not self.states:
            return
        s, ref = self.states[-1]
        row = ref[-1]
        if len(row) < 2:
            return
        got = next_logprobs(self.m, [row])[0]
        assert_close(got, self.m.full_logits(row)[-1].log_softmax(-1), self.m,
                     "the newest state's logits vs a fresh forward", cap=1e-3)
        self.m.store.verify()


Algebra.TestCase.settings = settings(max_examples=25, stateful_step_count=8, deadline=None)
TestAlgebra = Algebra.TestCase
