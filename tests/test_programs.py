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


def test_interruptible_calls_raise_interrupted(tiny):
    event = threading.Event()
    caught: list[BaseException] = []

    def work():
        with interruptible(event):
            try:
                ss.text(tiny)("Once", max_tokens=1500)
            except ss.Interrupted as exc:
                caught.append(exc)
            try:                        # a later call of the same program ends at once
                ss.text(tiny)("Again", max_tokens=1500)
            except ss.Interrupted as exc:
                caught.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(0.5)
    event.set()
    set_at = time.monotonic()
    thread.join(timeout=30)
    assert len(caught) == 2 and time.monotonic() - set_at < 1 + 2 * INTERRUPT_POLL_SECONDS
    # outside a run, nothing changes: a call is not interruptible
    assert ss.text(tiny)("Once", max_tokens=3).shape == (1, 1)
