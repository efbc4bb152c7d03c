"""Durable runs (seqstate/checkpoint.py): ``run_batch(..., checkpoint=path)`` keeps each
finished input's result, a rerun resumes, a crash loses only unfinished inputs."""

import dataclasses
import enum
import functools
import json
import linecache
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import types

import pydantic
import pytest

import seqstate as ss
from seqstate.checkpoint import _SCHEMA, Checkpoint

CHILD = pathlib.Path(__file__).parent / "children" / "checkpointed.py"


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Pet(pydantic.BaseModel):
    name: str
    legs: int


TYPES = (Colour, Pet)           # the classes counted's results hold


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
    first = ss.run_batch(program, range(5), checkpoint=path, progress=False, types=TYPES)
    assert len(calls) == 5
    again = ss.run_batch(program, range(5), checkpoint=path, progress=False, types=TYPES)
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
    first = ss.run_batch(program, range(4), checkpoint=path, progress=False, types=TYPES)
    with sqlite3.connect(path) as db:       # the last result's bytes cut short
        db.execute("UPDATE results SET data = substr(data, 1, 20) WHERE idx = 3")
    again = ss.run_batch(program, range(4), checkpoint=path, progress=False, types=TYPES)
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
    ss.run_batch(program, range(3), checkpoint=path, progress=False, types=TYPES)
    with pytest.raises(ss.CheckpointError, match="input list"):
        ss.run_batch(program, range(4), checkpoint=path, progress=False, types=TYPES)
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
    other = tmp_path / "other.sqlite"
    ss.run_batch(program, range(3), checkpoint=path, progress=False, types=TYPES)
    ss.run_batch(program, range(5), checkpoint=other, progress=False, types=TYPES)
    capsys.readouterr()
    with sqlite3.connect(other) as db:
        db.execute("DELETE FROM results WHERE idx >= 3")
    ss.run_batch(program, range(5), checkpoint=other, progress=True, types=TYPES)
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


# -- a program is its name and source, or the key the user gives --------------------------------
_MODULE = '''
def extract(x):
    """Extract."""
    assert x >= 0
    CALLS.append(x)
    return {"x": x, "double": 2 * x}
'''


def _load(tmp_path, source: str, name: str, optimize: int = 0, calls=None):
    """``extract`` of a module file holding ``source``, compiled with ``optimize``; it
    appends its inputs to ``calls``."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    linecache.checkcache(str(path))
    space = {"__name__": "checkpointed_program", "CALLS": [] if calls is None else calls}
    exec(compile(source, str(path), "exec", optimize=optimize), space)
    return space["extract"]


def test_a_program_compiled_to_other_bytecode_from_the_same_source_resumes(tmp_path):
    calls = []
    first = _load(tmp_path, _MODULE, "program", calls=calls)
    # another bytecode of the same source file, as another Python version compiles it
    other = _load(tmp_path, _MODULE, "program", optimize=2, calls=calls)
    assert first.__code__.co_code != other.__code__.co_code
    path = tmp_path / "run.sqlite"
    want = ss.run_batch(first, range(3), checkpoint=path, progress=False)
    assert ss.run_batch(other, range(3), checkpoint=path, progress=False) == want
    assert calls == [0, 1, 2]               # the rerun called nothing
    # an edited source is another program
    edited = _load(tmp_path, _MODULE.replace("2 * x", "x + x"), "program")
    with pytest.raises(ss.CheckpointError, match=r"program differs.*name and source.*"
                                                 r"ss\.checkpoint_results"):
        ss.run_batch(edited, range(3), checkpoint=path, progress=False)


def test_a_key_decides_what_program_a_checkpoint_belongs_to(tmp_path):
    calls = []
    path = tmp_path / "run.sqlite"

    def named(source, name):
        return _load(tmp_path, source, name, calls=calls)

    first = ss.run_batch(named(_MODULE, "v1"), range(3), checkpoint=path, key="extract-v2",
                         progress=False)
    # an edit of the docstring only (or of anything: the key decides) resumes under the key
    documented = _MODULE.replace('"""Extract."""', '"""Extract x and its double."""')
    assert ss.run_batch(named(documented, "v2"), range(3), checkpoint=path,
                        key="extract-v2", progress=False) == first
    assert calls == [0, 1, 2]
    with pytest.raises(ss.CheckpointError, match=r"program differs.*'key:extract-v3'"):
        ss.run_batch(named(documented, "v2"), range(3), checkpoint=path, key="extract-v3",
                     progress=False)
    with pytest.raises(ss.CheckpointError, match=r"named key='extract-v2'"):
        ss.run_batch(named(documented, "v2"), range(3), checkpoint=path, progress=False)
    assert calls == [0, 1, 2]
    # the models and the input list still count
    with pytest.raises(ss.CheckpointError, match="input list"):
        ss.run_batch(named(documented, "v2"), range(4), checkpoint=path, key="extract-v2",
                     progress=False)
    with pytest.raises(ss.ArgumentError, match="key must be a non-empty string"):
        ss.run_batch(_double, range(3), checkpoint=path, key="", progress=False)
    with pytest.raises(ss.ArgumentError, match="with checkpoint=path"):
        ss.run_batch(_double, range(3), key="extract-v2", progress=False)


def test_a_checkpoints_results_read_without_its_program(tmp_path, counted, tiny):
    program, calls = counted
    path = tmp_path / "run.sqlite"
    first = ss.run_batch(program, range(3), checkpoint=path, progress=False, types=TYPES)
    with pytest.raises(ss.CheckpointError, match="ss.checkpoint_results"):
        ss.run_batch(_double, range(3), checkpoint=path, progress=False)
    # without the model and classes: saved states and the classes' JSON
    bare = ss.checkpoint_results(path)
    assert sorted(bare) == [0, 1, 2]
    assert bare[1]["x"] == 1 and bare[1]["colour"] == "red"
    assert bare[1]["pet"] == first[1]["pet"].model_dump()
    saved = bare[1]["state"]
    assert isinstance(saved, ss.SavedState)
    assert ss.loads(tiny, saved).token_ids == first[1]["state"].token_ids
    # with them: the results as the run returned them
    full = ss.checkpoint_results(path, models=[tiny], types=TYPES)
    assert [full[i] for i in range(3)] == first
    with pytest.raises(ss.CheckpointError, match="no checkpoint file"):
        ss.checkpoint_results(tmp_path / "missing.sqlite")


def test_a_checkpoint_path_that_is_a_directory_is_refused_clearly(tmp_path):
    with pytest.raises(ss.CheckpointError, match=r"is a directory.*run\.sqlite"):
        ss.run_batch(_double, range(3), checkpoint=tmp_path, progress=False)


def _tokens_program(state):
    return state.token_ids


def test_states_are_inputs_by_their_whole_saved_form(tmp_path, tiny):
    ids = list(range(100, 170))
    a = ss.from_tokens(tiny, [ids])
    b = ss.from_tokens(tiny, [ids[:35] + [171] + ids[36:]])     # differs mid-text
    assert repr(a) == repr(b), "the test needs states whose reprs are equal"
    path = tmp_path / "run.sqlite"
    assert ss.run_batch(_tokens_program, [a], checkpoint=path, progress=False) == [a.token_ids]
    assert ss.run_batch(_tokens_program, [a], checkpoint=path, progress=False) == [a.token_ids]
    with pytest.raises(ss.CheckpointError, match="input list"):
        ss.run_batch(_tokens_program, [b], checkpoint=path, progress=False)


@dataclasses.dataclass
class Item:
    name: str
    size: int


def test_inputs_without_a_stable_identity_are_refused_before_anything_runs(tmp_path):
    calls = []

    def program(x):
        calls.append(x)
        return 1

    path = tmp_path / "run.sqlite"
    with pytest.raises(ss.CheckpointError, match=r"input 1 is a builtins\.object.*an id"):
        ss.run_batch(program, [1, object()], checkpoint=path, progress=False)
    with pytest.raises(ss.CheckpointError, match=r"input 0 is a builtins\.set"):
        ss.run_batch(program, [{"a", "b"}], checkpoint=path, progress=False)
    assert calls == []
    # dataclasses, bytes, tuples are data: a rerun resumes
    inputs = [Item("kettle", 2), b"\x00\x01", ("a", 1)]
    assert ss.run_batch(program, inputs, checkpoint=path, progress=False) == [1, 1, 1]
    assert ss.run_batch(program, inputs, checkpoint=path, progress=False) == [1, 1, 1]
    assert len(calls) == 3
    with pytest.raises(ss.CheckpointError, match="input list"):
        ss.run_batch(program, [Item("kettle", 3)] + inputs[1:], checkpoint=path,
                     progress=False)


def _generated(x, gen, max_tokens):
    return gen(f"Topic {x}:", max_tokens=max_tokens).generated


def test_a_partials_arguments_are_part_of_the_program(tmp_path, tiny):
    path = tmp_path / "run.sqlite"
    short = functools.partial(_generated, gen=ss.text(tiny), max_tokens=2)
    first = ss.run_batch(short, range(2), checkpoint=path, progress=False)
    again = functools.partial(_generated, gen=ss.text(tiny), max_tokens=2)   # equal partial
    assert ss.run_batch(again, range(2), checkpoint=path, progress=False) == first
    longer = functools.partial(_generated, gen=ss.text(tiny), max_tokens=6)
    with pytest.raises(ss.CheckpointError, match="program"):
        ss.run_batch(longer, range(2), checkpoint=path, progress=False)


# -- results come back as the first run returned them ------------------------------------------
def test_resumed_states_rebuild_their_values_classes(tmp_path, tiny):
    colour = ss.choice(tiny, Colour)

    def program(x):
        return colour(f"Colour {x}: ")

    path = tmp_path / "run.sqlite"
    first = ss.run_batch(program, range(3), checkpoint=path, progress=False, types=[Colour])
    again = ss.run_batch(program, range(3), checkpoint=path, progress=False, types=[Colour])
    assert all(isinstance(s.value, Colour) for s in first)
    assert [s.value for s in again] == [s.value for s in first]


def test_a_result_of_a_class_a_rerun_cannot_find_is_refused(tmp_path):
    class Local(pydantic.BaseModel):
        n: int

    with pytest.raises(ss.CheckpointError, match="input 0 cannot be stored.*Local"):
        ss.run_batch(lambda x: Local(n=x), [0], checkpoint=tmp_path / "run.sqlite",
                     progress=False)


def test_classes_are_rebuilt_only_from_types(tmp_path):
    def program(x):
        return [Pet(name="cat", legs=x)]

    path = tmp_path / "run.sqlite"
    with pytest.raises(ss.CheckpointError, match=r"input 0 cannot be stored.*types=\[Pet"):
        ss.run_batch(program, [4], checkpoint=path, progress=False)
    first = ss.run_batch(program, [4], checkpoint=path, progress=False, types=[Pet])
    assert ss.run_batch(program, [4], checkpoint=path, progress=False, types=[Pet]) == first
    with pytest.raises(ss.CheckpointError, match=r"test_checkpoint:Pet, classes not among "
                                                 r"types="):
        ss.run_batch(program, [4], checkpoint=path, progress=False)


# -- an interrupted run keeps no stand-in results --------------------------------------------------
def test_a_program_that_catches_interrupted_is_not_stored(tmp_path, tiny):
    text = ss.text(tiny)
    caught = []

    def program(x):
        if x == 0:
            time.sleep(0.5)             # the others are decoding
            return object()             # cannot be stored: the run stops, the others end
        try:
            return text(f"Story {x}:", max_tokens=1500).generated
        except ss.SeqStateError:        # Interrupted too
            caught.append(x)
            return None

    path = tmp_path / "run.sqlite"
    with pytest.raises(ss.CheckpointError, match="input 0"):
        ss.run_batch(program, range(4), concurrency=4, checkpoint=path, progress=False)
    assert sorted(caught) == [1, 2, 3]
    assert _count(path) == 0


def test_an_async_program_that_swallows_its_cancellation_is_not_stored(tmp_path, tiny,
                                                                     monkeypatch):
    import asyncio

    text = ss.text(tiny)
    caught, puts = [], []
    put = Checkpoint.put

    def recorded(self, idx, result):
        puts.append(idx)
        put(self, idx, result)

    monkeypatch.setattr(Checkpoint, "put", recorded)

    async def program(x):
        if x == 0:
            await asyncio.sleep(0.5)
            return object()
        try:
            return (await text.acall(f"Story {x}:", max_tokens=1500)).generated
        except (asyncio.CancelledError, ss.SeqStateError):
            caught.append(x)
            return None

    async def main():
        with pytest.raises(ss.CheckpointError, match="input 0"):
            await ss.arun_batch(program, range(4), checkpoint=tmp_path / "run.sqlite",
                                progress=False)
        await asyncio.sleep(0.5)            # the cancelled programs return their None

    asyncio.run(main())
    assert sorted(caught) == [1, 2, 3]
    assert puts == [0]                      # nothing was put in the (by then closed) store


# -- the database ---------------------------------------------------------------------------------
@pytest.fixture
def connections(monkeypatch):
    """The checkpoint connections opened during the test (a short busy timeout)."""
    opened = []
    connect = sqlite3.connect

    def tracked(*args, **kwargs):
        opened.append(connect(*args, **{**kwargs, "timeout": 0.2}))
        return opened[-1]

    monkeypatch.setattr(sqlite3, "connect", tracked)
    return opened


def _closed(db) -> bool:
    try:
        db.execute("SELECT 1")
    except sqlite3.ProgrammingError:
        return True
    return False


def test_a_refused_or_failed_checkpoint_is_closed(tmp_path, connections):
    path = tmp_path / "run.sqlite"
    ss.run_batch(_double, range(3), checkpoint=path, progress=False)
    with pytest.raises(ss.CheckpointError, match="program"):
        ss.run_batch(_triple, range(3), checkpoint=path, progress=False)
    # a new checkpoint that another process is writing as this run claims it
    fresh = tmp_path / "fresh.sqlite"
    holder = sqlite3.connect(fresh, isolation_level=None)       # tracked too
    holder.executescript(_SCHEMA)
    holder.execute("BEGIN EXCLUSIVE")
    with pytest.raises(ss.CheckpointError, match="locked"):
        ss.run_batch(_double, range(3), checkpoint=fresh, progress=False)
    holder.execute("ROLLBACK")
    holder.close()
    assert len(connections) == 4 and all(_closed(db) for db in connections)


def test_runs_starting_together_on_a_new_checkpoint_claim_it_once(tmp_path):
    path = tmp_path / "run.sqlite"
    start = threading.Barrier(6)
    errors = []

    def open_one():
        start.wait()
        try:
            Checkpoint(path, _double, range(3)).close()
        except Exception as exc:                # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM meta").fetchone()[0] == 5
