"""Interrupting a program run (seqstate/programs.py): Ctrl-C, a cancelled or timed-out
``arun_batch``, end every running program within about a second; the model stays usable."""

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

import seqstate as ss
from seqstate.engine import decode
from seqstate.engine.rows import RowRequest
from seqstate.engine.waiting import INTERRUPT_POLL_SECONDS, interruptible

CHILD = pathlib.Path(__file__).parent / "children" / "interrupted.py"
PROMPT = 1.0            # seconds the run decodes before the interrupt
LIMIT = 2.0             # "about a second", with room for a loaded 2-core machine


def _sigint_latency(engine: str, rounds: int, tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(CHILD.parents[2]))
    child = subprocess.Popen([sys.executable, str(CHILD), engine, str(rounds), str(tokens)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        json.loads(child.stdout.readline())         # {"running": ...}: the run has started
        time.sleep(PROMPT)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=300)
    finally:
        child.kill()
    report = json.loads(out.strip().splitlines()[-1])
    assert "interrupted" in report, f"the run ended before the interrupt: {report}"
    report["latency"] = report["interrupted"] - sent
    return report


@pytest.mark.parametrize("engine", ["hf", pytest.param("llama.cpp", marks=pytest.mark.llamacpp)])
def test_sigint_ends_every_running_program_promptly(engine):
    if engine == "llama.cpp":
        from conftest import request_llamacpp

        request_llamacpp()
    # 8 programs of 4 calls of 400 (hf tiny) or 100 (llama.cpp SmolLM2) tokens: tens of
    # seconds of work left when the interrupt comes
    report = _sigint_latency(engine, 4, 400 if engine == "hf" else 100)
    assert report["latency"] < LIMIT, report
    assert report["program_threads_left"] == 0
    assert report["usable"]             # the same greedy tokens as before the run
    assert report["held"] == 0          # no live state refers to stored KV: rows freed


def _long_program(model, ended):
    text = ss.text(model)

    def program(i):
        try:
            return text(f"Story {i}:", max_tokens=1500).generated
        except ss.Interrupted:
            ended.append(time.monotonic())
            raise
    return program


def test_a_timed_out_arun_batch_ends_its_thread_programs(tiny):
    ended: list[float] = []
    program = _long_program(tiny, ended)
    alone = ss.text(tiny)("Check:", max_tokens=6).token_ids

    async def main():
        await asyncio.wait_for(ss.arun_batch(program, range(4), progress=False), 1.0)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(main())
    timed_out = time.monotonic()
    deadline = timed_out + 10
    while len(ended) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ended) == 4 and max(ended) - timed_out < LIMIT
    assert ss.text(tiny)("Check:", max_tokens=6).token_ids == alone


def _interrupted_after(seconds: float, *calls) -> tuple[list[BaseException], float]:
    """Run ``calls`` one after another in a thread inside `interruptible`, set its event after
    ``seconds``; the `Interrupted` each raised, and the seconds from the event to the end."""
    event = threading.Event()
    caught: list[BaseException] = []

    def work():
        with interruptible(event):
            for call in calls:
                try:
                    call()
                except ss.Interrupted as exc:
                    caught.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(seconds)
    event.set()
    set_at = time.monotonic()
    thread.join(timeout=30)
    return caught, time.monotonic() - set_at


def test_interruptible_calls_raise_interrupted(tiny):
    # a later call of the same program ends at once
    caught, took = _interrupted_after(0.5, lambda: ss.text(tiny)("Once", max_tokens=1500),
                                      lambda: ss.text(tiny)("Again", max_tokens=1500))
    assert len(caught) == 2 and took < 1 + 2 * INTERRUPT_POLL_SECONDS
    # outside a run, nothing changes: a call is not interruptible
    assert ss.text(tiny)("Once", max_tokens=3).shape == (1, 1)


def test_scoring_calls_of_an_interrupted_run_raise_interrupted(engine):
    state = ss.text(engine)("Once", max_tokens=3)
    want = state.score([" upon"]).logprobs
    event = threading.Event()
    event.set()
    before = engine.stats
    with interruptible(event):
        with pytest.raises(ss.Interrupted):
            state.score([" upon"])
        with pytest.raises(ss.Interrupted):
            state.next_logprobs()
        with pytest.raises(ss.Interrupted):
            ss.choice(engine, ["yes", "no"], method="score")(state)
    assert (engine.stats - before).prefill_tokens == 0
    assert state.score([" upon"]).logprobs == want      # outside the run: as before


def test_a_beam_search_ends_when_its_run_is_interrupted(tiny):
    state = ss.text(tiny)("Once", max_tokens=3)
    want = state.score([" upon"]).logprobs
    caught, took = _interrupted_after(
        0.5, lambda: ss.text(tiny)("Once", max_tokens=1500, sampler=ss.beam_search(3)))
    assert len(caught) == 1 and took < 1 + 2 * INTERRUPT_POLL_SECONDS
    assert state.score([" upon"]).logprobs == want          # the model is as it was


def _drain(steps) -> None:
    for _ in steps:
        pass


@pytest.mark.parametrize("entry", ["decode.run", "runner.beam"])
def test_engine_calls_started_without_a_caller_are_interruptible(tiny, entry):
    # no caller given: the call builds its own when it starts, inside the run, so the run's
    # interrupt reaches it (a caller built at import belonged to no run)
    request = RowRequest(tuple(tiny.encode("Once")), 1500)
    if entry == "decode.run":
        call = lambda: _drain(decode.run(tiny, [request]))
    else:
        call = lambda: _drain(tiny.runner.beam([[(request, 0.0, 0)]], ss.beam_search(3)))
    caught, took = _interrupted_after(0.5, call)
    assert len(caught) == 1 and took < 1
    # outside a run the same call runs to its end
    assert len(decode.generate(tiny, [RowRequest(request.tokens, 3)])[0].tokens) == 4
