"""Concurrent calls share decode steps, and a call's result never depends on the others."""

import asyncio
import gc
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import seqstate as ss
from seqstate.backends.base import CacheFullError
from seqstate.engine.scheduler import _Run
from seqstate.engine.rows import RowRequest
from seqstate.engine.logprob_jobs import BackendJob
from seqstate.hooks import Rollback

from conftest import assert_close, verify_store

TOPICS = ["rain", "cats", "tea", "maps", "bees", "jazz", "salt", "wind"]


def chained(model, seed=None):
    """A 3-call program mixing free text, a choice and a regex (sampled when seeded)."""
    sampler = ss.multinomial(temperature=0.9) if seed is not None else ss.greedy()

    def program(topic):
        kw = dict(sampler=sampler, seed=seed) if seed is not None else {}
        s = ss.text(model)(f"Write about {topic}:", max_tokens=6, **kw)
        s = ss.choice(model, ["good", "bad", "so-so"])(s + "\nVerdict:", **kw)
        s = ss.regex(model, r"[0-9]{1,2}")(s + "\nScore:", **kw)
        return s.token_ids, s.value
    return program


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_concurrent_programs_equal_sequential(engine, seed):
    program = chained(engine, seed)
    alone = [program(t) for t in TOPICS]
    before = engine.stats
    together = ss.run_batch(program, TOPICS, concurrency=8, progress=False)
    used = engine.stats - before
    assert together == alone
    # the calls really shared forwards: fewer forwards than decode tokens
    assert used.forward_calls < used.decode_tokens
    verify_store(engine)


def test_a_failing_call_fails_alone(tiny):
    program = chained(tiny)

    def sometimes_bad(i):
        if i == 2:
            return ss.text(tiny)("x", max_tokens=0)               # bad input
        if i == 5:
            def boom(event):
                if len(event.generated) == 2:
                    raise RuntimeError("hook failed")
            return ss.text(tiny)("y", max_tokens=8, hooks=[boom])
        return program(TOPICS[i])

    results = ss.run_batch(sometimes_bad, range(8), concurrency=8, progress=False)
    assert isinstance(results[2], ss.ArgumentError)
    assert isinstance(results[5], RuntimeError) and "hook failed" in str(results[5])
    for i in (0, 1, 3, 4, 6, 7):
        assert results[i] == program(TOPICS[i])
    with pytest.raises(ss.BatchError) as info:
        ss.run_batch(sometimes_bad, range(8), progress=False, return_exceptions=False)
    assert set(info.value.errors) == {2, 5} and len(info.value.results) == 8


def test_interrupts_and_abandoned_streams_leave_others_running(tiny):
    expected = ss.text(tiny)("Still here", max_tokens=12).token_ids
    got, errors = [], []

    def steady():
        got.append(ss.text(tiny)("Still here", max_tokens=12).token_ids)

    def interrupted():
        def stop(event):
            if len(event.generated) == 3:
                raise KeyboardInterrupt
        try:
            ss.text(tiny)("Stop me", max_tokens=12, hooks=[stop])
        except KeyboardInterrupt as exc:
            errors.append(exc)

    def abandoned():
        stream = ss.text(tiny).stream("Never finished", max_tokens=40)
        next(stream)
        del stream
        gc.collect()

    threads = [threading.Thread(target=f) for f in (steady, interrupted, abandoned, steady)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == [expected, expected] and len(errors) == 1
    assert ss.text(tiny)("Still here", max_tokens=12).token_ids == expected
    tiny.store.verify()


def test_beam_search_and_scoring_join_with_others(tiny):
    beam = lambda p: ss.text(tiny)(p, sampler=ss.beam_search(3), max_tokens=4).token_ids  # noqa: E731
    score = lambda p: ss.choice(tiny, ["yes", "no"], method="score")(p).scores  # noqa: E731
    alone = [beam("One"), score("Two"), beam("Three")]
    together = ss.run_batch(lambda f: f(), [lambda: beam("One"), lambda: score("Two"),
                                            lambda: beam("Three")], progress=False)
    assert together[0] == alone[0] and together[2] == alone[2]
    assert together[1].keys() == alone[1].keys()
    assert_close([together[1][k] for k in alone[1]], list(alone[1].values()), tiny,
                 "a scored choice batched with beams vs alone")


def test_async_calls(tiny):
    gen = ss.text(tiny)
    expected = [gen(t, max_tokens=5).token_ids for t in TOPICS[:4]]

    async def main():
        return await asyncio.gather(*(gen.acall(t, max_tokens=5) for t in TOPICS[:4]))

    assert [s.token_ids for s in asyncio.run(main())] == expected


def test_progress_bar_shows_and_can_be_silenced(tiny, capsys):
    ss.run_batch(lambda t: ss.text(tiny)(t, max_tokens=1), TOPICS[:3], progress=True)
    assert "3/3" in capsys.readouterr().err
    ss.run_batch(lambda t: ss.text(tiny)(t, max_tokens=1), TOPICS[:3], progress=False)
    assert capsys.readouterr().err == ""


def test_soak_of_concurrent_random_programs(fresh_tiny):
    m = fresh_tiny
    m.store.budget_bytes = 1 << 20
    text = ss.text(m)

    def program(seed):
        rng = random.Random(seed)
        s = text(f"Program {seed}:", max_tokens=rng.randint(1, 6))
        for _ in range(5):
            op = rng.choice(["gen", "fork", "slice", "concat", "rollback"])
            if op == "gen":
                s = text(s, max_tokens=rng.randint(1, 4))
            elif op == "fork":
                s = text(s[:, :1, :], num_samples=rng.randint(2, 3), sampler=ss.multinomial(),
                         seed=seed, max_tokens=2)[:, :1, :]
            elif op == "slice":
                s = s[..., : max(1, len(s.token_ids[0][0]) - rng.randint(1, 3))]
            elif op == "concat":
                s = s + f" then {seed}"
            else:
                s = text(s, max_tokens=4, hooks=[lambda e: Rollback(1) if len(e.generated) == 2
                                                 and e.position % 2 else None])
        return s.token_ids

    first = ss.run_batch(program, range(24), concurrency=12, progress=False)
    assert all(not isinstance(r, BaseException) for r in first)
    m.store.verify()
    assert first == [program(i) for i in range(24)]
    m.store.verify()



def test_a_hook_that_calls_a_generator_runs_it_inline(tiny):
    expected = ss.text(tiny)("Inner", max_tokens=3).token_ids
    seen = []

    def nested(event):
        if not seen:                     # runs on the scheduler's worker: must not deadlock
            seen.append(ss.text(tiny)("Inner", max_tokens=3).token_ids)
        return None

    ss.text(tiny)("Outer", max_tokens=4, hooks=[nested])
    assert seen == [expected]
    tiny.store.verify()


def test_unknown_engine_is_an_argument_error():
    with pytest.raises(ss.ArgumentError, match="engine"):
        ss.models.default(engine="vllm")


@pytest.mark.llamacpp
def test_llamacpp_worker_runs_torch_single_threaded_and_leaves_other_threads_alone(
        llama, monkeypatch):
    import torch

    import seqstate.backends.hf.backend as hf_backend

    def threads_seen_by_hook(model):
        seen = []
        ss.text(model)("Hi", max_tokens=1, hooks=[lambda e: seen.append(torch.get_num_threads())])
        return seen[0]

    before = torch.get_num_threads()
    assert threads_seen_by_hook(llama) == 1          # the step runs on the worker thread
    assert torch.get_num_threads() == before         # this thread is untouched
    later = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [before]                         # and so are threads started later
    # the HF engine's worker takes torch's threads, but no more than the CPUs that no other
    # process ran on as it started (sampled once: patched here, as the machine's load varies)
    for free, want in ((64, before), (1, 1)):
        monkeypatch.setattr(hf_backend, "free_cpus", lambda: free)
        assert threads_seen_by_hook(ss.models.testing.tiny()) == want


class _Rows(ss.engine.scheduler.Job):
    def __init__(self, rows, order):
        super().__init__()
        self.rows, self.order = rows, order

    def needs(self):
        return self.rows, 4

    def joined(self, slots):
        self.slots = slots


class _FakeBatch:
    """Refuses rows ``never`` (cannot fit even alone) and ``full`` (no room now)."""

    def __init__(self, never=None, full=None):
        self.adds, self.released, self.never, self.full, self.next = [], [], never, full, 0

    def batch(self):                   # the backend too
        return self

    def add(self, rows, grow_by):
        if any(r == self.never for r in rows):
            raise ss.ContextOverflowError("too long")
        if any(r == self.full for r in rows):
            raise CacheFullError("full now")
        self.adds.append(list(rows))
        self.next += len(rows)
        return list(range(self.next - len(rows), self.next))

    def release(self, slot):
        self.released.append(slot)


def _admitted(batch, jobs):
    run = _Run(batch)
    run.waiting = list(jobs)
    run._admit()
    return run


def test_newcomers_join_in_one_add_and_a_refused_one_fails_alone():
    jobs = [_Rows([[1, 2], [1, 3]], 0), _Rows([[4]], 1), _Rows([[5, 6]], 2)]
    batch = _FakeBatch()
    assert _admitted(batch, jobs).running == jobs
    assert batch.adds == [[[1, 2], [1, 3], [4], [5, 6]]]          # one prefill for everyone
    assert [j.slots for j in jobs] == [[0, 1], [2], [3]]

    jobs = [_Rows([[1, 2]], 0), _Rows([[9, 9]], 1), _Rows([[5, 6]], 2)]
    batch = _FakeBatch(never=[9, 9])
    assert _admitted(batch, jobs).running == [jobs[0], jobs[2]]
    assert batch.adds == [[[1, 2]], [[5, 6]]]                     # retried one by one
    kind, error = jobs[1].outbox.get_nowait()
    assert kind == "error" and isinstance(error, ss.ContextOverflowError)


def test_a_newcomer_that_finds_the_cache_full_waits_and_fails_only_alone():
    jobs = [_Rows([[1, 2]], 0), _Rows([[7, 7]], 1), _Rows([[5, 6]], 2)]
    batch = _FakeBatch(full=[7, 7])
    run = _admitted(batch, jobs)
    # the full one waits for an older job to leave, and the one after it waits behind it
    assert run.running == [jobs[0]] and run.waiting == jobs[1:] and run.blocked
    assert jobs[1].outbox.empty()
    run._end(jobs[0], RuntimeError("gone"))
    run._admit()                                                  # alone now: it cannot fit
    kind, error = jobs[1].outbox.get_nowait()
    assert kind == "error" and isinstance(error, CacheFullError)
    assert run.running == [jobs[2]] and not run.waiting


def test_an_older_newcomer_that_finds_the_cache_full_pauses_newer_jobs():
    old, new = _Rows([[7, 7]], 0), _Rows([[5, 6]], 1)
    batch = _FakeBatch(full=[7, 7])
    run = _admitted(batch, [new])
    assert run.running == [new]
    batch.full = None
    real_add = batch.add

    def add(rows, grow_by):                      # full until the newer job has left
        if new.slots:
            raise CacheFullError("full now")
        return real_add(rows, grow_by)

    batch.add = add
    run.waiting = [old]
    run._admit()
    assert run.running == [old] and run.waiting == [new] and batch.released == [0]


def test_scoring_and_next_logprobs_are_jobs_on_the_worker(tiny, monkeypatch):
    """Scoring and next-token log-probs run on the scheduler's worker between decode steps
    (no lock of their own), and what runs beside them changes nothing."""
    prefixes = [tiny.encode("Is the sky blue?"), tiny.encode("Is grass red? Answer")]
    options = [tiny.encode(" yes"), tiny.encode(" no"), tiny.encode(" maybe not")]
    pairs = [(p, o) for p in prefixes for o in options]
    direct = tiny.backend.score(pairs)
    on = []
    real_score = tiny.backend.score
    monkeypatch.setattr(tiny.backend, "score", lambda p, **kw: on.append(
        threading.current_thread().name) or real_score(p, **kw))

    def story(i):
        return ss.text(tiny)(f"Story {i}:", max_tokens=12).token_ids

    alone = [story(i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        stories = [pool.submit(story, i) for i in range(4)]
        scored = ss.engine.score(tiny, pairs)
        logprobs = ss.engine.next_logprobs(tiny, prefixes)
        assert [s.result() for s in stories] == alone
    assert on and all(name.startswith("seqstate-scheduler") for name in on)
    for got, want in zip(scored, direct):
        assert_close(got.logprobs, want.logprobs, tiny, "scores on the worker vs direct")
    for row, got in zip(prefixes, logprobs):
        assert_close(got, tiny.full_logits(row)[-1].log_softmax(-1), tiny,
                     "next_logprobs on the worker vs a fresh forward", cap=1e-3)


def test_next_logprobs_rows_share_the_running_calls_forward(fresh_tiny, monkeypatch):
    """`NextJob`'s rows join the running batch: one forward feeds them with a decoding
    call's rows, and their distributions equal a fresh evaluation's."""
    from seqstate.engine.decode import DecodeJob
    from seqstate.engine.logprob_jobs import NextJob
    from seqstate.engine.rows import Decoding

    m = fresh_tiny
    rows = [m.encode("Is the sky blue?"), m.encode("Grass is")]
    decoding = DecodeJob(m, [RowRequest(tuple(m.encode("Once upon a time")), max_new=8)],
                         Decoding(max_backtracks=0))
    reading = NextJob(rows)
    decoding.order, reading.order = 0, 1
    run = _Run(m.backend)
    forwards = []
    real = run.batch.forward
    monkeypatch.setattr(run.batch, "forward", lambda slots, feeds: forwards.append(
        len(slots)) or real(slots, feeds))
    run.waiting = [decoding, reading]
    with torch.inference_mode():
        run.step()
    assert forwards == [3]                            # one forward: 1 decoding + 2 read rows
    kind, got = reading.outbox.get_nowait()
    assert kind == "done" and run.running == [decoding] and not reading.slots
    for row, lp in zip(rows, got):
        assert_close(lp, m.full_logits(row)[-1].log_softmax(-1), m,
                     "next_logprobs beside a decoding row vs a fresh forward")
    run.close()


def test_a_scoring_job_that_finds_the_cache_full_waits_for_a_job_to_leave():
    room = []

    def work(backend):
        if not room:
            raise CacheFullError("full now")
        return "scored"

    old, scoring = _Rows([[1, 2]], 0), BackendJob(work)
    scoring.order = 1
    run = _admitted(_FakeBatch(), [old, scoring])
    assert run.running == [old] and run.waiting == [scoring] and run.blocked
    assert scoring.outbox.empty()
    room.append(True)
    run._end(old, RuntimeError("gone"))
    run._admit()
    assert scoring.outbox.get_nowait() == ("done", "scored")
    assert not run.running and not run.waiting


def test_a_long_scoring_call_lets_other_calls_decode_between_its_parts(fresh_tiny, monkeypatch):
    """Scoring runs on the worker one part (of `ROWS_PER_STEP` distinct rows) per step, so a
    call decoding beside it keeps stepping; the scores equal those of one part."""
    from seqstate.engine import logprob_jobs

    m = fresh_tiny
    rows = [m.encode(f"Question {i}: is {i} even?") for i in range(6)]
    pairs = [(r, m.encode(o)) for r in rows for o in (" yes", " no")]
    whole = ss.engine.score(m, pairs)
    monkeypatch.setattr(logprob_jobs, "ROWS_PER_STEP", 1)
    seen = []                              # decode tokens counted when each part starts
    real = m.backend.score
    monkeypatch.setattr(m.backend, "score", lambda part, **kw: seen.append(
        m.backend.counters["decode_tokens"]) or real(part, **kw))
    started = threading.Event()

    def story():
        return ss.text(m)(["Once upon a time", "In a land far away"], max_tokens=300,
                          hooks=[lambda event: started.set()]).token_ids

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(story)
        assert started.wait(30)
        parted = ss.engine.score(m, pairs)
        running.result()
    assert len(seen) == len(rows)
    assert all(b > a for a, b in zip(seen, seen[1:]))       # decode steps ran between parts
    for got, want in zip(parted, whole):
        assert_close(got.logprobs, want.logprobs, m, "scores in parts vs in one part")


def test_the_worker_calls_the_backends_start_hook_on_its_own_thread(fresh_tiny, monkeypatch):
    started = []
    monkeypatch.setattr(fresh_tiny.backend, "on_worker_start",
                        lambda: started.append(threading.current_thread().name))
    ss.text(fresh_tiny)("Hello", max_tokens=2)
    assert len(started) == 1 and started[0].startswith("seqstate-scheduler")
