"""Calls from an event loop: ``acall``/``aresume``/``astream`` without a thread per call,
cancellation and ``timeout=`` that end a call's rows and release what they held, and
``arun_batch`` — on every engine."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import pytest

import seqstate as ss
from conftest import assert_same_rows, collect

LONG = "[0-9]{500}"        # no row finishes early: 500 digits, a token each, then done


def run(coro):
    return asyncio.run(coro)


def same(got, want) -> None:
    """Equal tokens and log-probs within the engine's noise (a server's: the exactness bound, 1e-3;
    its batches differ between two runs of the same request)."""
    if want.model.engine != "vllm":
        assert_same_rows(got, want)
        return
    assert got.token_ids == want.token_ids
    for a, b in zip(got.rows, want.rows):
        assert all(abs(x - y) < 1e-3 for x, y in zip(a.logprobs, b.logprobs)
                   if x is not None and y is not None)


def running_requests(model) -> float:
    """Requests the vLLM server is running now (its own Prometheus gauge)."""
    with urllib.request.urlopen(f"{model.url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


async def started(model, before: ss.models.base.Stats) -> None:
    """Wait until a call is decoding (a server: running a request)."""
    deadline = time.monotonic() + 30
    while not (running_requests(model) > 0 if model.engine == "vllm"
               else model.stats.decode_tokens > before.decode_tokens):
        assert time.monotonic() < deadline, "the call never started decoding"
        await asyncio.sleep(0.05)


def settled(model, before: ss.models.base.Stats, seconds: float = 20.0) -> None:
    """Wait until a cancelled call's rows are gone: the engine decodes nothing more and
    holds what it held before (a server runs none of its requests)."""
    deadline = time.monotonic() + seconds
    while True:
        now = model.stats
        if model.engine == "vllm":
            quiet = running_requests(model) == 0
        else:
            time.sleep(0.3)
            quiet = model.stats.decode_tokens == now.decode_tokens
        if quiet and now.kv_bytes_held == before.kv_bytes_held:
            return
        assert time.monotonic() < deadline, (
            f"the cancelled call still runs: held {now.kv_bytes_held} vs {before.kv_bytes_held}")
        time.sleep(0.2)


def test_acall_and_aresume_equal_the_blocking_calls(engine):
    gen = ss.text(engine)
    want = gen("The capital of France is", max_tokens=8)
    got = run(gen.acall("The capital of France is", max_tokens=8))
    same(got, want)
    cut = want[..., :-3]
    same(run(gen.aresume(cut, max_tokens=8)), gen.resume(cut, max_tokens=8))


def test_astream_yields_the_chunks_of_stream(engine):
    gen = ss.text(engine)
    chunks, want = collect(gen.stream(["Once upon a time", "Hello"], max_tokens=10))

    async def main():
        stream = gen.astream(["Once upon a time", "Hello"], max_tokens=10)
        return [c async for c in stream], stream.state

    got_chunks, got = run(main())
    # each row's chunks (rows of a server interleave as its tokens arrive)
    assert sorted(got_chunks, key=lambda c: c[:2]) == sorted(chunks, key=lambda c: c[:2])
    same(got, want)


def test_an_unfinished_astream_has_no_state_yet(tiny):
    with pytest.raises(ss.ArgumentError, match="has not ended"):
        ss.text(tiny).astream("Hello", max_tokens=3).state


def test_concurrent_acalls_join_one_batch_without_a_thread_each(tiny):
    gen = ss.text(tiny)
    prompts = [f"Prompt number {i}:" for i in range(256)]
    before = tiny.stats
    ss.run_batch(lambda p: gen(p, max_tokens=16), prompts, concurrency=256, progress=False)
    batched = (tiny.stats - before).forward_calls
    threads = []

    async def main():
        calls = [asyncio.ensure_future(gen.acall(p, max_tokens=16)) for p in prompts]
        while not all(c.done() for c in calls):
            threads.append(threading.active_count())
            await asyncio.sleep(0.01)
        return [c.result() for c in calls]

    start, before = threading.active_count(), tiny.stats
    states = run(main())
    forwards = (tiny.stats - before).forward_calls
    # 256 calls share decode steps as run_batch's 256 threads do
    assert forwards <= 1.1 * batched, (forwards, batched)
    # the scheduler's worker is the only thread added (run_batch needs 256)
    assert max(threads) <= start + 1, (max(threads), start)
    for p, s in zip(prompts[:8], states[:8]):
        assert s.token_ids == gen(p, max_tokens=16).token_ids


def test_cancelling_an_acall_ends_its_rows_and_leaves_the_others(engine):
    other = ss.text(engine)
    want = other("Tell me a story:", max_tokens=12)
    before = engine.stats

    async def main():
        doomed = asyncio.ensure_future(ss.regex(engine, LONG).acall("Digits:", max_tokens=500))
        kept = asyncio.ensure_future(other.acall("Tell me a story:", max_tokens=12))
        await started(engine, before)
        assert not doomed.done(), "the call ended before it could be cancelled"
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return await kept

    same(run(main()), want)
    settled(engine, before)
    again = ss.text(engine)("Tell me a story:", max_tokens=12)         # the model still works
    same(again, want)


def test_closing_a_stream_early_ends_its_rows(engine):
    before = engine.stats
    stream = ss.regex(engine, LONG).stream("Digits:", max_tokens=500)
    assert next(stream)
    stream.close()
    settled(engine, before)

    async def main():
        stream = ss.regex(engine, LONG).astream("Digits:", max_tokens=500)
        async for chunk in stream:
            assert chunk
            break
        await stream.aclose()

    run(main())
    settled(engine, before)


def test_a_timeout_raises_and_ends_the_rows(engine):
    gen = ss.regex(engine, LONG)
    before = engine.stats
    start = time.monotonic()
    with pytest.raises(ss.CallTimeout, match="timeout=0.5 s"):
        gen("Digits:", max_tokens=500, timeout=0.5)
    assert time.monotonic() - start < 5
    settled(engine, before)
    with pytest.raises(ss.CallTimeout):
        run(gen.acall("Digits:", max_tokens=500, timeout=0.5))
    settled(engine, before)
    with pytest.raises(TimeoutError):                 # a built-in TimeoutError too
        gen("Digits:", max_tokens=500, timeout=0.2)
    settled(engine, before)


def test_a_beam_search_keeps_its_timeout_and_leaves_the_event_loop_free(engine):
    gen = ss.regex(engine, LONG)
    before = engine.stats
    start = time.monotonic()
    with pytest.raises(ss.CallTimeout):
        gen("Digits:", max_tokens=500, sampler=ss.beam_search(2), timeout=0.5)
    assert time.monotonic() - start < 5
    settled(engine, before)
    # a search long enough to span many ticks on this machine: its length doubles until the
    # search, called plainly, takes a second
    for n in (12, 24, 48, 96, 192, 384, 500):
        start = time.monotonic()
        want = gen("Digits:", max_tokens=n, sampler=ss.beam_search(2))
        if time.monotonic() - start >= 1.0:
            break
    ticks = []

    async def ticking():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)

    async def main():
        clock = asyncio.ensure_future(ticking())
        await asyncio.sleep(0)                   # the ticker has started
        try:
            start = time.monotonic()
            got = await gen.acall("Digits:", max_tokens=n, sampler=ss.beam_search(2))
            return got, start, time.monotonic()
        finally:
            clock.cancel()

    got, start, end = run(main())
    assert got.token_ids == want.token_ids
    # the loop ran other work while the beams were searched: it ticked all through the call,
    # with no gap near the whole call's length (a search that blocks the loop has one)
    assert end - start >= 0.5, f"the search took {end - start:.2f} s: too short to measure"
    during = [start] + [t for t in ticks if start < t < end] + [end]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) >= 5 and max(gaps) < (end - start) / 2, (end - start, gaps)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "5"])
def test_a_bad_timeout_is_refused_before_compute(tiny, bad):
    with pytest.raises(ss.ArgumentError, match="timeout must be"):
        ss.text(tiny)("Hello", timeout=bad)


def test_arun_batch_keeps_order_and_the_error_rules(tiny):
    yes_no = ss.choice(tiny, ["yes", "no"])

    async def program(topic):
        if topic == "bad":
            raise ValueError("a bad input")
        return (await yes_no.acall(f"Is {topic} good? ")).value

    topics = ["cats", "bad", "dogs", "owls"]
    want = [yes_no(f"Is {t} good? ").value if t != "bad" else None for t in topics]
    got = run(ss.arun_batch(program, topics, concurrency=2, progress=False))
    assert [g if not isinstance(g, Exception) else None for g in got] == want
    assert isinstance(got[1], ValueError)
    with pytest.raises(ss.BatchError) as caught:
        run(ss.arun_batch(program, topics, progress=False, return_exceptions=False))
    assert list(caught.value.errors) == [1]
    # a plain function runs on a thread, as run_batch runs it
    plain = run(ss.arun_batch(lambda t: yes_no(f"Is {t} good? ").value, ["cats", "dogs"],
                              progress=False))
    assert plain == [want[0], want[2]]
    with pytest.raises(ss.ArgumentError, match="concurrency"):
        run(ss.arun_batch(program, topics, concurrency=0))


def test_cancelling_arun_batch_cancels_its_programs(tiny):
    before = tiny.stats
    gen = ss.regex(tiny, LONG)

    async def main():
        batch = asyncio.ensure_future(ss.arun_batch(
            lambda i: gen.acall(f"Digits {i}:", max_tokens=500), range(4), progress=False))
        await started(tiny, before)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch

    run(main())
    settled(tiny, before)


def test_a_scored_choice_from_an_event_loop(tiny):
    pick = ss.choice(tiny, ["yes", "no", "maybe"], method="score")
    assert run(pick.acall("Is it? ")).value == pick("Is it? ").value
