"""Durable runs (seqstate/checkpoint.py): ``run_batch(..., checkpoint=path)`` keeps each
finished input's result, a rerun resumes, a crash loses only unfinished inputs."""

import enum
import json
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import time
import types

import pydantic
import pytest

import seqstate as ss

CHILD = pathlib.Path(__file__).parent / "children" / "checkpointed.py"


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Pet(pydantic.BaseModel):
    name: str
    legs: int


def _count(path) -> int:
    try:
        with sqlite3.connect(path) as db:
            return db.execute("SELECT count(*) FROM results").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def test_sigkill_mid_run_then_rerun_resumes(tmp_path):
    path = tmp_path / "run.sqlite"
    env = dict(os.environ, PYTHONPATH=str(CHILD.parents[2]))
    child = subprocess.Popen([sys.executable, str(CHILD), str(path), "run"], env=env)
    deadline = time.monotonic() + 240
    while _count(path) < 4 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    held = _count(path)
    assert 4 <= held < 12, f"the kill came at {held} of 12 results; the test needs a mid-run kill"
    out = subprocess.run([sys.executable, str(CHILD), str(path), "rerun"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["held"] >= held
    # the program ran only for inputs the checkpoint did not hold
    assert report["calls"] == report["inputs"] - report["held"]
    assert report["equal"]              # the same results, in input order, as a fresh run


@pytest.fixture
def counted(tiny):
    calls = []
    text = ss.text(tiny)

    def program(x):
        calls.append(x)
        s = text(f"Topic {x}:", max_tokens=3)
        return {"x": x, "state": s, "pair": (x, 0.5), "colour": Colour.RED,
                "pet": Pet(name=s.generated, legs=x)}

    return program, calls


def test_rerun_returns_stored_results_without_calling_the_program(tmp_path, counted):
    program, calls = counted
    path = tmp_path / "run.sqlite"
    first = ss.run_batch(program, range(5), checkpoint=path, progress=False)
    assert len(calls) == 5
    again = ss.run_batch(program, range(5), checkpoint=path, progress=False)
    assert len(calls) == 5
    for a, b in zip(first, again):
        assert b["x"] == a["x"] and b["pair"] == a["pair"] and b["colour"] is Colour.RED
        assert isinstance(b["pet"], Pet) and b["pet"] == a["pet"]      # re-validated
        assert b["state"] == a["state"] and b["state"].model is a["state"].model
        assert b["state"].generated == a["state"].generated
        assert b["state"].logprobs == a["state"].logprobs


def test_torn_last_write_is_run_again(tmp_path, counted):
    program, calls = counted
    path = tmp_path / "run.sqlite"
    first = ss.run_batch(program, range(4), checkpoint=path, progress=False)
    with sqlite3.connect(path) as db:       # the last result's bytes cut short
        db.execute("UPDATE results SET data = substr(data, 1, 20) WHERE idx = 3")
    again = ss.run_batch(program, range(4), checkpoint=path, progress=False)
    assert calls == [0, 1, 2, 3, 3] or sorted(calls) == [0, 1, 2, 3, 3]
    assert [r["state"].token_ids for r in again] == [r["state"].token_ids for r in first]


def test_failed_inputs_are_not_stored(tmp_path, tiny):
    calls = []

    def program(x):
        calls.append(x)
        if x == 1 and calls.count(1) == 1:
            raise ValueError("flaky")
        return x * 2

    path = tmp_path / "run.sqlite"
    assert isinstance(ss.run_batch(program, range(3), checkpoint=path, progress=False)[1],
                      ValueError)
    assert ss.run_batch(program, range(3), checkpoint=path, progress=False) == [0, 2, 4]
    assert sorted(calls) == [0, 1, 1, 2]


def _double(x):
    return 2 * x


def _triple(x):
    return 3 * x


def test_a_checkpoint_of_another_run_is_refused(tmp_path, counted):
    program, calls = counted
    path = tmp_path / "run.sqlite"
    ss.run_batch(program, range(3), checkpoint=path, progress=False)
    with pytest.raises(ss.CheckpointError, match="input list"):
        ss.run_batch(program, range(4), checkpoint=path, progress=False)
    with pytest.raises(ss.CheckpointError, match="program"):
        ss.run_batch(_double, range(3), checkpoint=path, progress=False)
    assert len(calls) == 3
    # a program of the same name whose code changed
    ss.run_batch(_double, range(3), checkpoint=tmp_path / "double.sqlite", progress=False)
    edited = types.FunctionType(_triple.__code__.replace(
        co_name="_double", co_qualname="_double"), globals(), "_double")
    with pytest.raises(ss.CheckpointError, match="program"):
        ss.run_batch(edited, range(3), checkpoint=tmp_path / "double.sqlite", progress=False)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    path = tmp_path / "run.sqlite"
    for seed in (0, 1):
        model = ss.models.testing.tiny(seed=seed)

        def program(x):
            return ss.text(model)(f"Topic {x}:", max_tokens=2).generated

        if seed == 0:
            ss.run_batch(program, range(2), checkpoint=path, progress=False)
        else:
            with pytest.raises(ss.CheckpointError, match="models"):
                ss.run_batch(program, range(2), checkpoint=path, progress=False)


def test_a_result_that_cannot_be_stored_stops_the_run_at_the_first(tmp_path, tiny):
    calls = []

    def program(x):
        calls.append(x)
        time.sleep(0.05)
        return object()

    with pytest.raises(ss.CheckpointError, match="input 0 cannot be stored"):
        ss.run_batch(program, range(40), concurrency=2, checkpoint=tmp_path / "run.sqlite",
                     progress=False)
    assert len(calls) < 10


def test_progress_counts_resumed_inputs(tmp_path, capsys, counted):
    program, calls = counted
    path = tmp_path / "run.sqlite"
    ss.run_batch(program, range(3), checkpoint=path, progress=False)
    ss.run_batch(program, range(5), checkpoint=tmp_path / "other.sqlite", progress=False)
    capsys.readouterr()
    with sqlite3.connect(tmp_path / "other.sqlite") as db:
        db.execute("DELETE FROM results WHERE idx >= 3")
    ss.run_batch(program, range(5), checkpoint=tmp_path / "other.sqlite", progress=True)
    err = capsys.readouterr().err
    assert "5/5" in err and "3/5" in err


def test_arun_batch_resumes_from_a_checkpoint(tmp_path, tiny):
    import asyncio

    calls = []
    yes_no = ss.choice(tiny, ["yes", "no"])

    async def program(topic):
        calls.append(topic)
        return (await yes_no.acall(f"Is {topic} good? ")).value

    path = tmp_path / "run.sqlite"
    first = asyncio.run(ss.arun_batch(program, ["cats", "dogs"], checkpoint=path,
                                      progress=False))
    again = asyncio.run(ss.arun_batch(program, ["cats", "dogs"], checkpoint=path,
                                      progress=False))
    assert again == first and len(calls) == 2
