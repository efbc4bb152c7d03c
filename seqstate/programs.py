"""Running a program over many inputs at once: its generator calls share decode steps."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from seqstate.checkpoint import Checkpoint
from seqstate.engine.waiting import interruptible
from seqstate.errors import ArgumentError, SeqStateError
from seqstate.progress import progress_bar, quiet_calls

__all__ = ["run_batch", "arun_batch", "BatchError"]

T = TypeVar("T")


class BatchError(SeqStateError, RuntimeError):
    """Some inputs of `run_batch()` failed (``return_exceptions=False``).

    ``results`` holds every input's result in order, the exception in place of a failed one;
    ``errors`` maps the failed inputs' indices to their exceptions.
    """

    def __init__(self, results: list[Any], errors: dict[int, BaseException]) -> None:
        first = min(errors)
        super().__init__(f"{len(errors)} of {len(results)} inputs failed; the first, input "
                         f"{first}: {errors[first]!r}.  `.results` holds every result in order, "
                         "`.errors` the exceptions by index")
        self.results, self.errors = results, errors


def run_batch(program: Callable[[Any], T], inputs: Iterable[Any], *, concurrency: int = 16,
              progress: bool | None = None, return_exceptions: bool = True,
              checkpoint: str | os.PathLike | None = None) -> list[T | BaseException]:
    """Run ``program(input)`` for every input, ``concurrency`` at a time; results in input order.

    ``program`` is plain Python that calls generators (any number, any kind, on states it
    builds).  The calls of concurrent programs join one running batch per model at the next
    decode step and leave it when they finish, so a batch of programs runs several times
    faster than a loop.  A call's result does not depend on what else runs (greedy output is
    the same as alone; a seeded call samples with its own RNG).

    Ctrl-C ends every running program within about a second: each one's generator call
    raises `seqstate.Interrupted`, its rows leave the batch, and ``KeyboardInterrupt``
    reaches the caller; the model stays usable.

    Parameters
    ----------
    program : callable
        A function of one input.
    inputs : iterable
        The inputs; the result list has one entry per input, in order.
    concurrency : int, default 16
        Programs in flight at once (threads); 16 keeps a CPU busy without large batches.
    progress : bool or None, default None
        Show a tqdm progress bar on standard error; default (None): when it is a terminal.
        ``SEQSTATE_PROGRESS=0`` in the environment turns it off.
    return_exceptions : bool, default True
        True: a failed input's entry is its exception, and the others are kept.  False: raise
        `BatchError` (holding every result) after all inputs ran.
    checkpoint : str or path, optional
        An SQLite file (`seqstate.checkpoint`): each input's result is written to it durably
        as soon as its program returns; run again with the same file, finished inputs get
        their stored results without their program being called, the others run, and the
        results keep input order.  Results must be JSON values, states, pydantic models,
        enums, or tuples, lists and dicts of those (the first that is not stops the run with
        `seqstate.CheckpointError`); a failed input is not stored (a rerun tries it again),
        nor is anything once the run is interrupted.  Inputs must be data (JSON values,
        states, pydantic models, enums, dataclasses, bytes, or tuples, lists and dicts of
        those).  A checkpoint of another program, model or input list, or an input of another
        type, is refused with `seqstate.CheckpointError` before anything runs.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> def program(topic):
    ...     s = ss.text(model)(f"A word about {topic}:", max_tokens=3)
    ...     return ss.choice(model, ["yes", "no"])(s + " Good? ").value
    >>> answers = ss.run_batch(program, ["cats", "dogs", "owls"], progress=False)
    >>> len(answers), all(a in ("yes", "no") for a in answers)
    (3, True)
    """
    items = _inputs(program, inputs, concurrency, progress, return_exceptions)
    results: list[Any] = [None] * len(items)
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()
    interrupt = threading.Event()
    store, done = _resumed(checkpoint, program, items, results)
    with progress_bar(progress, len(items), "seqstate", "input", call=False) as bar, \
            contextlib.closing(store) if store is not None else contextlib.nullcontext():
        _count_resumed(bar, done)

        def one(i: int) -> None:
            if interrupt.is_set():
                return
            try:
                with quiet_calls(), interruptible(interrupt):
                    results[i] = program(items[i])
            except Exception as exc:                 # noqa: BLE001 - reported per input
                with lock:
                    results[i] = exc
                    errors[i] = exc
            else:
                # once the run is interrupted, a result may be a program's stand-in for the
                # call that raised Interrupted: a rerun runs the input again
                if store is not None and not interrupt.is_set():
                    store.put(i, results[i])         # CheckpointError: the run stops
            if bar is not None:
                bar.update(1)

        pool = ThreadPoolExecutor(max_workers=min(concurrency, max(len(items), 1)),
                                  thread_name_prefix="seqstate-run-batch")
        try:
            for future in [pool.submit(one, i) for i in range(len(items)) if i not in done]:
                future.result()
        except BaseException:
            # Ctrl-C: start nothing new, and end the running programs' calls (each raises
            # Interrupted within a poll), so the wait below is short
            interrupt.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            pool.shutdown(wait=True)
    if errors and not return_exceptions:
        raise BatchError(results, errors)
    return results


def _inputs(program: Callable, inputs: Iterable[Any], concurrency: int, progress: bool | None,
            return_exceptions: bool) -> list[Any]:
    """The inputs as a list, every argument checked first (`run_batch`, `arun_batch`)."""
    # every argument is checked before a generator of inputs is consumed
    if not callable(program):
        raise ArgumentError(f"program must be a function of one input, got {program!r}")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ArgumentError(f"concurrency must be an int >= 1, got {concurrency!r}")
    if progress is not None and not isinstance(progress, bool):
        raise ArgumentError(f"progress must be True, False or None (automatic), got {progress!r}")
    if not isinstance(return_exceptions, bool):
        raise ArgumentError(f"return_exceptions must be True or False, got {return_exceptions!r}")
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Iterable):
        raise ArgumentError(f"inputs must be an iterable of inputs (a list, a generator), got "
                            f"{type(inputs).__name__} {inputs!r:.60}; for one input write [x]")
    return list(inputs)


def _resumed(checkpoint: Any, program: Callable, items: list[Any], results: list[Any]
             ) -> tuple[Checkpoint | None, dict[int, Any]]:
    """The run's checkpoint (None without one) and the results it holds, by input index,
    put in ``results``."""
    if checkpoint is None:
        return None, {}
    store = Checkpoint(checkpoint, program, items)
    done = store.finished()
    for i, result in done.items():
        results[i] = result
    return store, done


def _count_resumed(bar: Any, done: dict[int, Any]) -> None:
    """The progress bar counts resumed inputs, and shows them at once."""
    if bar is not None and done:
        bar.update(len(done))
        bar.refresh()


async def arun_batch(program: Callable[[Any], Any], inputs: Iterable[Any], *,
                     concurrency: int = 16, progress: bool | None = None,
                     return_exceptions: bool = True,
                     checkpoint: str | os.PathLike | None = None) -> list[Any]:
    """`run_batch` from a running event loop: ``await ss.arun_batch(program, inputs)``.

    ``program`` is an ``async def`` function of one input (its generator calls are
    ``await gen.acall(...)``: no thread per input), or a plain function (run on a thread,
    as `run_batch` runs it).  The same rules as `run_batch`: results in input order,
    ``concurrency`` programs in flight, a progress bar, a failed input's exception in its
    place (or `BatchError` with ``return_exceptions=False``), ``checkpoint=``.  Cancelling
    the awaiting task (or a timeout around it) ends every program still running within about
    a second, plain ones on threads too (their calls raise `seqstate.Interrupted` and their
    rows leave the batch).

    Examples
    --------
    >>> import asyncio
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> yes_no = ss.choice(model, ["yes", "no"])
    >>> async def program(topic):
    ...     return (await yes_no.acall(f"Is {topic} good? ")).value
    >>> batch = ss.arun_batch(program, ["cats", "dogs"], progress=False)
    >>> all(a in ("yes", "no") for a in asyncio.run(batch))
    True
    """
    items = _inputs(program, inputs, concurrency, progress, return_exceptions)
    results: list[Any] = [None] * len(items)
    errors: dict[int, BaseException] = {}
    gate = asyncio.Semaphore(concurrency)
    # ends the calls of plain programs (run on threads, which a cancelled task leaves running)
    interrupt = threading.Event()
    store, done = _resumed(checkpoint, program, items, results)
    with progress_bar(progress, len(items), "seqstate", "input", call=False) as bar, \
            contextlib.closing(store) if store is not None else contextlib.nullcontext():
        _count_resumed(bar, done)

        async def one(i: int) -> None:
            async with gate:
                try:
                    with quiet_calls(), interruptible(interrupt):
                        if inspect.iscoroutinefunction(program):
                            out = await program(items[i])
                        else:
                            out = await asyncio.to_thread(program, items[i])
                        results[i] = await out if inspect.isawaitable(out) else out
                except Exception as exc:                 # noqa: BLE001 - reported per input
                    results[i] = exc
                    errors[i] = exc
                else:
                    # as in run_batch: nothing is kept once the run is interrupted (the store
                    # is closed then too, where a program swallowed its cancellation)
                    if store is not None and not interrupt.is_set():
                        store.put(i, results[i])     # CheckpointError: the run stops
            if bar is not None:
                bar.update(1)

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(items)) if i not in done]
        try:
            await asyncio.gather(*tasks)
        finally:
            interrupt.set()
            for task in tasks:
                task.cancel()
    if errors and not return_exceptions:
        raise BatchError(results, errors)
    return results
