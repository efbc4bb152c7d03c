"""Programs over a Ray cluster: ``seqstate.ray.run_batch`` and Ray Data's `Programs` class.

A model cannot travel to another process, so nothing here sends one: ``model`` is a
zero-argument factory and ``make(model)`` returns the program, and both run on each worker
(a Ray actor), which builds its model once.  Workers run their inputs with ``ss.run_batch``,
so the calls of their programs share decode steps as they do in one process.  Install with
``pip install "seqstate[ray]"``.

What a program returns travels back to the driver in a pickle: plain values, pydantic models,
enums and the like as they are; a state as ``ss.SavedState`` (its saved bytes:
``ss.loads(model, saved)`` binds it to a model of the same tokenizer).  A result that holds a
model, or another object that cannot be pickled, is replaced by `seqstate.ArgumentError` in
its place, as a failed input.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from seqstate.checkpoint_identity import is_model
from seqstate.errors import ArgumentError, EngineError, SeqStateError
from seqstate.programs import BatchError, _inputs
from seqstate.programs import run_batch as _run_batch
from seqstate.progress import progress_bar

__all__ = ["run_batch", "Programs", "CHUNK"]

CHUNK = 16
"""Inputs per chunk: a worker is sent chunks of this many consecutive inputs, and each chunk
keeps its own checkpoint file, so a rerun with any number of workers finds them."""

# each worker runs this many chunks at once: while one chunk's last programs finish, the
# other's keep its batch full
_DEPTH = 2
_RESTARTS = 3


def run_batch(make: Callable[[Any], Callable[[Any], Any]], inputs: Iterable[Any], *,
              model: Callable[[], Any], workers: int | None = None,
              checkpoint: str | os.PathLike | None = None, key: str | None = None,
              types: Iterable[type] = (), concurrency: int = 16,
              progress: bool | None = None, return_exceptions: bool = True,
              **ray_options: Any) -> list[Any]:
    """Run ``make(model())(input)`` for every input on Ray workers; results in input order.

    Each worker is a Ray actor that calls ``model()`` and ``make(model)`` once, then runs the
    chunks of inputs it is sent (`CHUNK` consecutive inputs each) with ``ss.run_batch``,
    ``concurrency`` programs in flight.  Chunks go to whichever worker is free, so a slow
    worker takes fewer.  A failed input's entry is its exception, as with ``ss.run_batch``.

    A worker that dies (its process killed, its node lost) is restarted by Ray, which builds
    its model again and sends it the chunks it was running: their inputs run again (those a
    checkpoint holds do not), and the results come back whole.  A worker that dies three
    times (``max_restarts``) ends the run with `seqstate.EngineError`.  A factory that raises
    on a worker, a ``make`` that returns no function, or a checkpoint of another run ends the
    run with that error, raised here; so does Ctrl-C.  Either way the run's actors are
    killed.

    Parameters
    ----------
    make : callable
        ``make(model)`` returns the program, a function of one input.  Sent to the workers
        in a pickle (cloudpickle: a function defined in a script or a notebook travels).
    inputs : iterable
        The inputs (picklable data); the result list has one entry per input, in order.
    model : callable
        A zero-argument factory of the model, such as ``ss.models.default`` or ``lambda:
        ss.models.vllm(urls)`` (then the workers are clients of the vLLM servers).
    workers : int, optional
        The number of actors; default: as many as the cluster's CPUs (GPUs, with
        ``num_gpus``) hold, and never more than there are chunks.
    checkpoint : str or path, optional
        A folder (shared storage on a cluster): each chunk's results are kept there in a
        `seqstate.checkpoint` file of its own, named by the chunk's inputs; run again with
        the same folder, finished inputs get their stored results and no program is called
        for them.  The results must be what a checkpoint stores (see ``ss.run_batch``).
    key : str, optional
        With ``checkpoint``: the program's name in the checkpoint files (``ss.run_batch``'s
        ``key``).  Without it a worker reads the program's source (``inspect.getsource``),
        which a function defined in a notebook or an interactive prompt has not there.
    types : iterable of classes, optional
        With ``checkpoint``: the pydantic models and enums results hold (``ss.run_batch``'s
        ``types``).
    concurrency : int, default 16
        Programs in flight in each chunk (``ss.run_batch``'s ``concurrency``); a worker runs
        two chunks at once while it has them, so that one's last programs overlap the next
        one's first.
    progress : bool or None, default None
        A progress bar of finished chunks' inputs on standard error (None: when it is a
        terminal).
    return_exceptions : bool, default True
        False: raise `seqstate.BatchError` (holding every result) when an input failed.
    **ray_options
        Options of the actors (``num_gpus=1``, ``num_cpus``, ``resources={...}``,
        ``max_restarts`` ...); ``num_cpus`` is 1 unless given.

    Examples
    --------
    >>> import seqstate as ss
    >>> import seqstate.ray
    >>> def make(model):
    ...     yes_no = ss.choice(model, ["yes", "no"])
    ...     return lambda topic: yes_no(f"Is {topic} good? ").value
    >>> answers = seqstate.ray.run_batch(make, ["cats", "dogs"],  # doctest: +SKIP
    ...                                  model=ss.models.default, workers=2)
    """
    _check_factories(make, model)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise ArgumentError(f"workers must be an int >= 1 or None (as many as the cluster "
                            f"holds), got {workers!r}")
    items = _inputs(make, inputs, concurrency, progress, return_exceptions)
    types = tuple(types)
    ray = _ray()
    folder = None
    if checkpoint is not None:
        folder = Path(checkpoint)
        if folder.exists() and not folder.is_dir():
            raise ArgumentError(f"checkpoint must name a folder (each chunk of inputs keeps a "
                                f"file there), and {str(folder)!r} is a file")
    chunks = [(start, items[start:start + CHUNK]) for start in range(0, len(items), CHUNK)]
    results: list[Any] = [None] * len(items)
    if not chunks:
        return results
    depth = min(_DEPTH, concurrency)
    options = {"num_cpus": 1, "max_restarts": _RESTARTS, "max_task_retries": _RESTARTS,
               "max_concurrency": depth, **ray_options}
    try:
        actor = ray.remote(_Worker).options(**options)
    except (TypeError, ValueError) as exc:
        raise ArgumentError(f"Ray refuses the actor options {ray_options}: {exc}") from None
    if not ray.is_initialized():
        ray.init()
    count = min(workers or _fits(ray, options), len(chunks))
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    actors = [actor.remote(make, model) for _ in range(count)]
    try:
        with progress_bar(progress, len(items), "seqstate.ray", "input", call=False) as bar:
            pending = list(reversed(chunks))
            running: dict[Any, tuple[int, Any]] = {}          # ref -> (chunk start, actor)
            load = {i: 0 for i in range(count)}
            while pending or running:
                # one chunk to each worker in turn, so that a short run uses every worker
                for i in [i for _ in range(depth) for i in range(count)]:
                    if pending and load[i] < depth:
                        start, part = pending.pop()
                        path = None if folder is None else str(_chunk_file(folder, start, part))
                        ref = actors[i].run.remote(part, start, path, concurrency, key, types)
                        running[ref] = (start, i)
                        load[i] += 1
                done, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
                for ref in done:
                    start, i = running.pop(ref)
                    load[i] -= 1
                    part = _result(ray, ref, start)
                    results[start:start + len(part)] = part
                    if bar is not None:
                        bar.update(len(part))
    finally:
        for a in actors:
            ray.kill(a)
    errors = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
    if errors and not return_exceptions:
        raise BatchError(results, errors)
    return results


class Programs:
    """A program over Ray Data's batches: ``ds.map_batches(Programs, fn_constructor_kwargs=
    {"make": make, "model": factory}, concurrency=N, batch_size=B)``.

    Ray Data makes ``N`` of these (actors); each calls ``model()`` and ``make(model)`` once,
    then runs the program over each batch's rows with ``ss.run_batch``.  A row is passed to
    the program as its ``item`` value where ``item`` is the dataset's only column (a dataset
    made by ``ray.data.from_items`` of plain values), else as a dict of its columns.  The
    batch comes back with two columns added: ``result`` (the program's return value; None for
    a failed row) and ``error`` (None, or the failed row's exception as ``"Type: message"``).

    Parameters
    ----------
    make : callable
        ``make(model)`` returns the program, a function of one row.
    model : callable
        A zero-argument factory of the model.
    concurrency : int, default 16
        Programs in flight on each actor (``ss.run_batch``'s ``concurrency``).
    """

    def __init__(self, make: Callable[[Any], Callable[[Any], Any]],
                 model: Callable[[], Any], concurrency: int = 16) -> None:
        _check_factories(make, model)
        self.program = _program(make, model)
        self.concurrency = concurrency

    def __call__(self, batch: Any) -> dict[str, Any]:
        columns = batch.to_dict("list") if hasattr(batch, "to_dict") else dict(batch)
        columns = {k: v.tolist() if isinstance(v, np.ndarray) else list(v)
                   for k, v in columns.items()}
        rows = (columns["item"] if list(columns) == ["item"] else
                [dict(zip(columns, values)) for values in zip(*columns.values())])
        out = _run_batch(self.program, rows, concurrency=self.concurrency, progress=False)
        out = [_portable(r, i) for i, r in enumerate(out)]
        result, error = np.empty(len(out), dtype=object), np.empty(len(out), dtype=object)
        for i, r in enumerate(out):
            failed = isinstance(r, BaseException)
            result[i] = None if failed else r
            error[i] = f"{type(r).__name__}: {r}" if failed else None
        return {**columns, "result": result, "error": error}


class _Worker:
    """A Ray actor's object: the program, built once on the worker, over chunks of inputs."""

    def __init__(self, make: Callable, model: Callable) -> None:
        # an error is kept, and raised by run(): the driver then ends the run with it (an
        # error raised here would leave Ray restarting the actor)
        self.error: BaseException | None = None
        try:
            self.program = _program(make, model)
        except Exception as exc:                     # noqa: BLE001 - raised by run()
            self.error = exc

    def run(self, inputs: list[Any], start: int, checkpoint: str | None, concurrency: int,
            key: str | None, types: tuple[type, ...]) -> list[Any]:
        if self.error is not None:
            raise self.error
        out = _run_batch(self.program, inputs, concurrency=concurrency, progress=False,
                         checkpoint=checkpoint, key=key, types=types)
        return [_portable(r, start + i) for i, r in enumerate(out)]


def _check_factories(make: Any, model: Any) -> None:
    if not callable(make):
        raise ArgumentError(f"make must be a function of the model that returns the program, "
                            f"got {make!r:.60}")
    if not callable(model) or is_model(model):
        raise ArgumentError(f"model must be a zero-argument factory of the model (such as "
                            f"ss.models.default, or a lambda), not {model!r:.60}: a model "
                            "cannot travel to a worker, each worker builds its own")


def _program(make: Callable, model: Callable) -> Callable[[Any], Any]:
    program = make(model())
    if not callable(program):
        raise ArgumentError(f"make(model) must return the program, a function of one input; "
                            f"it returned {program!r:.60}")
    return program


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ArgumentError('seqstate.ray needs Ray: pip install "seqstate[ray]"') from None
    return ray


def _fits(ray: Any, options: dict[str, Any]) -> int:
    """How many actors of these options the cluster's CPUs (or GPUs) hold, at least one."""
    total = ray.cluster_resources()
    if options.get("num_gpus"):
        return max(1, int(total.get("GPU", 0) // options["num_gpus"]))
    return max(1, int(total.get("CPU", 1) // (options.get("num_cpus") or 1)))


def _chunk_file(folder: Path, start: int, part: list[Any]) -> Path:
    return folder / f"inputs-{start}-{start + len(part) - 1}.sqlite"


def _result(ray: Any, ref: Any, start: int) -> list[Any]:
    """A chunk's results; a worker's error (its factory's, its make's, its checkpoint's) is
    raised as it was raised there."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        raise (cause if isinstance(cause, BaseException) else exc) from None
    except RayActorError as exc:
        raise EngineError(f"the worker running inputs from {start} died and was restarted "
                          f"too often ({exc}); what a checkpoint holds is kept, a rerun "
                          "runs the rest") from None


def _portable(result: Any, index: int) -> Any:
    """The result if it can travel to the driver in a pickle, else an error in its place."""
    from ray import cloudpickle

    class Refusing(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            if is_model(obj):
                raise ArgumentError("it holds a model")
            return super().reducer_override(obj)

    try:
        Refusing(io.BytesIO()).dump(result)
    except Exception as exc:                         # noqa: BLE001 - reported in its place
        what = "exception" if isinstance(result, BaseException) else "result"
        return (SeqStateError if what == "exception" else ArgumentError)(
            f"the {what} of input {index} ({type(result).__name__}) cannot be sent back from "
            f"the worker: {exc}; return plain values, pydantic models or states (a state "
            "comes back as ss.SavedState)")
    return result
