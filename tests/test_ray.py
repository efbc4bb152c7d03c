"""seqstate.ray on a local Ray cluster, checked against ss.run_batch in this process.

One Ray session serves the module (it takes seconds to start); each run starts its actors,
which import seqstate and build their model.  Workers are other processes, so what a program
did there (calls, kills, model builds) is counted in files of a test's folder.
"""

import functools
import os
import pathlib
import sys
import time

import numpy as np
import pytest
import ray

import seqstate as ss
import seqstate.ray as sray


@pytest.fixture(scope="module", autouse=True)
def cluster():
    from ray import cloudpickle

    # the module's functions travel by value: the workers need not import tests/
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _mark(folder, name):
    with open(pathlib.Path(folder) / name, "a") as f:
        f.write("x\n")


def _count(folder, name):
    path = pathlib.Path(folder) / name
    return len(path.read_text().splitlines()) if path.exists() else 0


def _cpus_freed():
    """Whether the cluster's two CPUs are free again within ten seconds (actors killed)."""
    for _ in range(50):
        if ray.available_resources().get("CPU") == 2:
            return True
        time.sleep(0.2)
    return False


def tiny_factory(folder=None):
    if folder is not None:
        _mark(folder, "builds")
    return ss.models.testing.tiny()


def make_program(model, folder=None, kill_at=None, model_at=7):
    """Words about a number and the state; input 5 raises, input ``model_at`` returns the
    model (which cannot travel), input ``kill_at`` ends its worker's process once."""
    text = ss.text(model)

    def program(x):
        if folder is not None:
            _mark(folder, "calls")
            if x == kill_at and not (pathlib.Path(folder) / "killed").exists():
                _mark(folder, "killed")
                os._exit(1)
        if x == 5:
            raise ValueError("five")
        if x == model_at:
            return model
        s = text(f"Number {x} is", max_tokens=4)
        return s.value, s

    return program


INPUTS = list(range(40))          # three chunks


@pytest.fixture(scope="module")
def reference():
    model = ss.models.testing.tiny()
    return model, ss.run_batch(make_program(model), INPUTS, progress=False)


def _same(got, reference):
    model, expected = reference
    assert len(got) == len(expected)
    for x, (g, e) in enumerate(zip(got, expected)):
        if x == 5:
            assert isinstance(g, ValueError) and str(g) == "five"
        elif x == 7:
            assert isinstance(g, ss.ArgumentError) and "holds a model" in str(g)
        else:
            value, saved = g
            assert isinstance(saved, ss.SavedState)
            assert value == e[0] and ss.loads(model, saved) == e[1], x


def test_results_equal_run_batch_in_one_process(reference, tmp_path):
    got = sray.run_batch(functools.partial(make_program, folder=str(tmp_path)), INPUTS,
                         model=tiny_factory, workers=2)
    _same(got, reference)
    assert _count(tmp_path, "calls") == len(INPUTS)


def test_a_rerun_with_the_checkpoint_calls_no_finished_input(reference, tmp_path):
    folder, store = tmp_path / "marks", tmp_path / "run"
    folder.mkdir()
    # no model among the results: a checkpoint stores states and data, not a model
    make = functools.partial(make_program, folder=str(folder), model_at=None)
    first = sray.run_batch(make, INPUTS, model=tiny_factory, workers=2, checkpoint=store)
    assert _count(folder, "calls") == len(INPUTS)
    assert sorted(p.name for p in store.glob("*.sqlite")) == [
        "inputs-0-15.sqlite", "inputs-16-31.sqlite", "inputs-32-39.sqlite"]
    model, expected = reference
    for x, (f, e) in enumerate(zip(first, expected)):
        if x != 5:
            assert f[0] == (e[0] if x != 7 else f[0]) and ss.loads(model, f[1]).value == f[0]
    assert isinstance(first[5], ValueError)
    # one worker now: only the failed input runs again
    with pytest.raises(ss.BatchError) as caught:
        sray.run_batch(make, INPUTS, model=tiny_factory, workers=1, checkpoint=store,
                       return_exceptions=False)
    assert _count(folder, "calls") == len(INPUTS) + 1
    again = caught.value.results
    assert list(caught.value.errors) == [5]
    for x, (a, f) in enumerate(zip(again, first)):
        if x != 5:
            assert a[0] == f[0] and ss.loads(model, a[1]) == ss.loads(model, f[1]), x


def test_a_killed_worker_s_inputs_finish(reference, tmp_path):
    got = sray.run_batch(functools.partial(make_program, folder=str(tmp_path), kill_at=20),
                         INPUTS, model=functools.partial(tiny_factory, str(tmp_path)),
                         workers=2)
    assert (tmp_path / "killed").exists()
    _same(got, reference)
    assert _count(tmp_path, "builds") == 3          # two workers, one of them again


def make_dying(model):
    def program(x):
        if x == 3:
            os._exit(1)                                 # every time: no restart helps
        return x

    return program


def test_a_worker_that_dies_past_max_restarts_ends_the_run():
    with pytest.raises(ss.EngineError, match="died and was restarted too often"):
        sray.run_batch(make_dying, range(6), model=tiny_factory, workers=1, max_restarts=1)
    assert _cpus_freed()


def test_ray_data_programs_give_the_same_results(reference):
    ds = ray.data.from_items(INPUTS).map_batches(
        sray.Programs, fn_constructor_kwargs={"make": make_program, "model": tiny_factory},
        concurrency=2, batch_size=8)
    rows = sorted(ds.take_all(), key=lambda row: row["item"])
    model, expected = reference
    assert [row["item"] for row in rows] == INPUTS
    for row, e in zip(rows, expected):
        if row["item"] == 5:
            assert row["result"] is None and row["error"] == "ValueError: five"
        elif row["item"] == 7:
            assert row["result"] is None and row["error"].startswith("ArgumentError:")
        else:
            assert row["error"] is None
            assert row["result"][0] == e[0] and ss.loads(model, row["result"][1]) == e[1]


def test_programs_pass_a_row_dict_where_there_are_columns():
    """Called in this process as Ray Data calls it, on a batch of numpy columns."""
    def make(model):
        return lambda row: ss.choice(model, row["options"])(row["topic"] + "? ").value

    batch = {"topic": np.array(["cats", "dogs"]),
             "options": np.array([["yes", "no"], ["up", "down"]])}
    out = sray.Programs(make, ss.models.testing.tiny)(batch)
    model = ss.models.testing.tiny()
    expected = ss.run_batch(make(model), [{"topic": "cats", "options": ["yes", "no"]},
                                         {"topic": "dogs", "options": ["up", "down"]}],
                            progress=False)
    assert list(out["result"]) == expected and list(out["error"]) == [None, None]
    assert list(out["topic"]) == ["cats", "dogs"]


def _raises():
    raise RuntimeError("no weights here")


@pytest.mark.parametrize("make, model, error", [
    (make_program, _raises, RuntimeError),
    (lambda model: "not a program", tiny_factory, ss.ArgumentError),
])
def test_a_worker_s_setup_error_ends_the_run(make, model, error):
    start = time.monotonic()
    with pytest.raises(error):
        sray.run_batch(make, INPUTS, model=model, workers=2)
    assert time.monotonic() - start < 120
    assert _cpus_freed()                                       # its actors were killed


@pytest.mark.parametrize("kwargs, match", [
    ({"make": "make", "model": tiny_factory}, "make must be"),
    ({"make": make_program, "model": None}, "model must be"),
    ({"make": make_program, "model": ss.models.testing.tiny()}, "model must be"),
    ({"make": make_program, "model": tiny_factory, "workers": 0}, "workers must be"),
    ({"make": make_program, "model": tiny_factory, "concurrency": 0}, "concurrency must be"),
    ({"make": make_program, "model": tiny_factory, "num_cpus": "x"}, "actor options"),
])
def test_bad_input_is_refused_before_any_worker_starts(kwargs, match):
    make = kwargs.pop("make")
    with pytest.raises(ss.ArgumentError, match=match):
        sray.run_batch(make, [1, 2], **kwargs)


def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ss.ArgumentError, match=r'pip install "seqstate\[ray\]"'):
        sray.run_batch(make_program, [1, 2], model=tiny_factory)


def chained(model):
    text, verdict = ss.text(model), ss.choice(model, ["positive", "negative"])

    def review(product):
        s = text(f"A one-line review of a {product}:", max_tokens=12, stop_at="\n")
        return verdict(s + "\nSentiment:").value

    return review


@pytest.mark.real
def test_smollm2_on_llama_cpp_equals_run_batch(llama):
    """The llama.cpp engine's model built on each worker (SmolLM2 on transformers runs on
    Ray in docs/beyond-one-machine.md; the tiny model's tests are transformers' too)."""
    products = ["kettle", "bicycle", "umbrella", "lamp", "tent", "chair", "desk", "clock"]
    factory = functools.partial(ss.models.default, engine="llama.cpp", n_ctx=8192,
                                n_threads=1)
    got = sray.run_batch(chained, products, model=factory, workers=2)
    assert got == ss.run_batch(chained(llama), products, progress=False)


def make_sleeper(model, folder):
    def sleeper(x):
        _mark(folder, "calls")
        time.sleep(5)
        return x

    return sleeper


def test_ctrl_c_ends_the_run_and_kills_its_actors(tmp_path):
    import _thread
    import threading

    def interrupt_once_a_program_runs():
        while not (tmp_path / "calls").exists():
            time.sleep(0.1)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_once_a_program_runs, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        sray.run_batch(functools.partial(make_sleeper, folder=str(tmp_path)), range(200),
                       model=tiny_factory, workers=2)
    assert _cpus_freed()
    assert _count(tmp_path, "calls") < 200
