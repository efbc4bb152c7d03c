"""Reliability: bounded memory under a soak, threads sharing a model, dead ends, bad input."""

import gc
import pathlib
import random
import resource
import threading
import warnings

import pytest
import torch

import seqstate as ss
from seqstate.engine import Stepper, next_logprobs
from conftest import assert_close


def test_soak_budget_pins_and_release(fresh_tiny):
    m = fresh_tiny
    per_token = m.num_layers * 2 * m.kv_heads * m.head_dim * 4
    m.store.budget_bytes = 3000 * per_token
    rnd = random.Random(0)
    gen = ss.text(m)
    live = [gen(f"seed {i} " * 5, max_tokens=3) for i in range(4)]
    peak_held = 0
    for step in range(2000):
        s = rnd.choice(live)
        op = rnd.randrange(5)
        if op == 0:
            s = gen(s, max_tokens=rnd.randint(1, 4))
        elif op == 1:
            s = gen(s, num_samples=rnd.randint(2, 3), sampler=ss.multinomial(), seed=step, max_tokens=2)[:, :1, :]
        elif op == 2:
            s = s[..., : max(1, len(s.token_ids[0][0]) - rnd.randint(1, 5))]
        elif op == 3:
            s = s + f" more {step}"
        else:
            s = gen(f"fresh {step} " * rnd.randint(1, 8), max_tokens=2)
        live.append(s)
        if len(live) > 12:
            live.pop(rnd.randrange(len(live)))
        peak_held = max(peak_held, m.stats.kv_bytes_held)
        if step % 200 == 0:
            m.store.verify()
            gc.collect()
            st = m.stats
            assert st.kv_bytes_cached <= m.store.budget_bytes + st.kv_bytes_held
    # pinned KV of every live state is intact and exact
    for s in live[-3:]:
        row = list(s.rows[0].tokens)
        if s.rows[0].handle is not None:
            assert m.store.match(row).length >= s.rows[0].handle.length
        fresh = m.full_logits(row)[-1].log_softmax(-1)
        assert_close(next_logprobs(m, [row])[0], fresh, m, "a kept state after the soak",
                     cap=1e-3)
    assert m.stats.evictions > 0
    del s, live[:]  # the loop variable holds the last state too
    gc.collect()
    m.store.verify()
    assert m.stats.kv_bytes_held == 0
    assert m.stats.kv_bytes_cached <= m.store.budget_bytes
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"soak: 2000 ops, peak held {peak_held / 2**20:.2f} MiB, evictions {m.stats.evictions}, "
          f"peak RSS {rss_mib:.0f} MiB")


def test_threads_share_a_model(tiny):
    prompts = [f"Thread {i} says" for i in range(6)]
    expected = {p: ss.text(tiny)(p, max_tokens=6).token_ids for p in prompts}
    shared = ss.text(tiny)("Shared state", max_tokens=3)
    got, errors = {}, []

    def work(p):
        try:
            got[p] = ss.text(tiny)(p, max_tokens=6).token_ids
            assert str(shared).startswith("Shared state") and shared.shape == (1, 1)
        except Exception as exc:     # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(p,)) for p in prompts for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == expected
    tiny.store.verify()


def test_dead_end_leaves_state_intact(tiny):
    base = ss.text(tiny)("x", max_tokens=2)
    # a grammar is not analysed up front, so the forced phrase becomes a run-time dead end
    s = ss.cfg(tiny, 'start: "only"')(base, hooks=[ss.hooks.ban_phrases(["only"])], max_backtracks=50)
    assert s.finish_reason in ("dead_end", "max_backtracks")
    assert s.token_ids[0][0][: len(base.token_ids[0][0])] == base.token_ids[0][0]
    tiny.store.verify()


BAD_INPUTS = [
    ("invalid regex", lambda m: ss.regex(m, "([a-z"), ss.ConstraintError),
    ("huge repetition", lambda m: ss.regex(m, "a{5000}"), ss.ConstraintError),
    ("huge regex", lambda m: ss.regex(m, "a" * 30_000), ss.ConstraintError),
    ("invalid schema", lambda m: ss.json(m, "{oops"), ss.ConstraintError),
    ("unsupported schema", lambda m: ss.json(m, {"type": "object", "patternProperties":
                                                 {"^a": {}, "^ab": {}}}), ss.ConstraintError),
    ("empty choices", lambda m: ss.choice(m, []), ss.ConstraintError),
    ("duplicate choices", lambda m: ss.choice(m, ["a", "b", "a"]), ss.ConstraintError),
    ("bad grammar", lambda m: ss.cfg(m, "start: ("), ss.ConstraintError),
    ("wrong arity", lambda m: ss.from_tokens(m, [[1, 2]])[0, 0, 0, 0], ss.SlicingError),
    ("out of range", lambda m: ss.from_tokens(m, [[1, 2]])[5], ss.SlicingError),
    ("bad key type", lambda m: ss.from_tokens(m, [[1, 2]])[{"a": 1}], ss.SlicingError),
    ("unknown capture", lambda m: ss.from_tokens(m, [[1, 2]])["a"], KeyError),
    ("mismatched batches", lambda m: ss.from_tokens(m, [[1], [2]]) + ss.from_tokens(m, [[1], [2], [3]]),
     ss.BatchMismatch),
    ("non-str prompt", lambda m: ss.text(m)(123), TypeError),
    ("beyond context", lambda m: ss.text(m)("word " * 3000), ss.ContextOverflowError),
    ("max_tokens <= 0", lambda m: ss.text(m)("x", max_tokens=0), ValueError),
    ("bad sampler", lambda m: ss.text(m)("x", sampler="greedy"), TypeError),
    ("bad temperature", lambda m: ss.multinomial(temperature=0), ValueError),
    ("samples mismatch", lambda m: ss.text(m)(ss.SequenceState(m, ss.from_tokens(m, [[1]]).rows * 2, 1, 2),
                                              num_samples=3), ss.SampleMismatch),
    ("NaN logits", lambda m: Stepper(m, [[1, 2]]).step(torch.full((1, m.vocab.size), float("nan"))),
     ValueError),
    ("token ids outside vocab", lambda m: ss.from_tokens(m, [[10**9]]), ValueError),
    ("nested repetition", lambda m: ss.regex(m, r"(a{500}){500}"), ss.ConstraintError),
    ("seed not an int", lambda m: ss.text(m)("x", seed="a"), ss.ArgumentError),
    ("rng not a Generator", lambda m: ss.text(m)("x", rng=42), ss.ArgumentError),
    ("fractional top_k", lambda m: ss.multinomial(top_k=2.5), ss.ArgumentError),
    ("top_p above 1", lambda m: ss.multinomial(top_p=1.5), ss.ArgumentError),
    ("bool num_samples", lambda m: ss.text(m)("x", num_samples=True), ss.ArgumentError),
    ("int stop_at", lambda m: ss.text(m)("x", stop_at=5), ss.ArgumentError),
    ("a hook, not a list", lambda m: ss.text(m)("x", hooks=lambda e: None), ss.ArgumentError),
    ("zero step", lambda m: ss.from_tokens(m, [[1, 2]])[..., ::0], ss.SlicingError),
    ("chat on a non-model", lambda m: ss.chat("not a model"), ss.ArgumentError),
    ("run_batch inputs not iterable", lambda m: ss.run_batch(lambda x: x, 5), ss.ArgumentError),
    ("run_batch progress not a bool", lambda m: ss.run_batch(lambda x: x, [1], progress="yes"),
     ss.ArgumentError),
    ("run_batch return_exceptions not a bool",
     lambda m: ss.run_batch(lambda x: x, [1], return_exceptions="no"), ss.ArgumentError),
    ("float bound", lambda m: ss.from_tokens(m, [[1, 2]])[..., :2.0], ss.SlicingError),
]

def test_empty_state_continues_from_the_start_token(tiny):
    text = ss.text(tiny)
    expected = text("", max_tokens=3).token_ids
    assert text(ss.from_tokens(tiny, [[]]), max_tokens=3).token_ids == expected
    base = text("Hello", max_tokens=2)
    before = base.token_ids
    assert text(base[..., :0], max_tokens=3).token_ids == expected
    assert base.token_ids == before                                 # the original is untouched


def test_numpy_integer_keys_work_like_ints(tiny):
    import numpy as np                  # a dependency of seqstate: never skipped
    s = ss.from_tokens(tiny, [[1, 2, 3], [4, 5, 6]])
    assert s[np.int64(1), :np.int32(2)].token_ids == s[1, :2].token_ids


def test_out_of_range_messages_name_shape_and_forms(tiny):
    s = ss.from_tokens(tiny, [[1, 2, 3]])
    for key in (7, (0, 0, 9), (Ellipsis, 5)):
        with pytest.raises(ss.SlicingError, match=r"shape \(1, 1\).*state\[batch, sample, token\]"):
            s[key]


@pytest.mark.parametrize("name,call,error", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_rejected_before_compute(fresh_tiny, name, call, error):
    before = fresh_tiny.stats
    with pytest.raises(error) as info:
        call(fresh_tiny)
    assert len(str(info.value)) > 20, "the message must say what to do"
    assert (fresh_tiny.stats - before).forward_calls == 0


def test_run_batch_checks_its_arguments_before_consuming_inputs():
    taken = []

    def inputs():
        for i in range(3):
            taken.append(i)
            yield i

    for bad in ({"concurrency": 0}, {"progress": "yes"}, {"return_exceptions": "no"}):
        with pytest.raises(ss.ArgumentError):
            ss.run_batch(lambda x: x, inputs(), **bad)
    with pytest.raises(ss.ArgumentError, match="program"):
        ss.run_batch("not callable", inputs())
    assert taken == []


def test_sources_compile_without_warnings():
    # an invalid escape such as "\w" in a docstring is a SyntaxWarning (an error in Python 3.14)
    root = pathlib.Path(ss.__file__).parent
    for path in sorted(root.rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")
    assert r"\bdelv\w*" in ss.hooks.ban_phrases.__doc__


def test_models_do_not_mix(tiny, fresh_tiny):
    with pytest.raises(ss.ModelMismatch):
        ss.text(fresh_tiny)(ss.from_tokens(tiny, [[1, 2]]))
