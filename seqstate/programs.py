"""Running a program over many inputs at once: its generator calls share decode steps."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Iterable, Iterator
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
              checkpoint: str | os.PathLike | None = None, key: str | None = None,
              types: Iterable[type] = ()) -> list[T | BaseException]:
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
        type, is refused with `seqstate.CheckpointError` before anything runs;
        ``ss.checkpoint_results(path)`` reads its results without the program.
    key : str or None, default None
        With ``checkpoint``: the program's name in it (such as ``"extract-v2"``), which then
        decides alone whether a checkpoint is this program's (an edited program resumes
        under the same key).  None: the program's qualified name and source text decide
        (`seqstate.checkpoint_identity`).
    types : iterable of classes, optional
        With ``checkpoint``: the pydantic models and enums results hold (inside states too),
        rebuilt into these classes when resumed; a result holding another such class stops
        the run with `seqstate.CheckpointError`.

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
    batch = _Batch(program, inputs, concurrency, progress, return_exceptions, checkpoint, key,
                   types)

    def one(i: int) -> None:
        if batch.interrupt.is_set():
            return
        try:
            with quiet_calls(), interruptible(batch.interrupt):
                result = program(batch.items[i])
        except Exception as exc:                 # noqa: BLE001 - reported per input
            batch.ended(i, exc)
        else:
            batch.ended(i, result)

    with batch.running(progress):
        pool = ThreadPoolExecutor(max_workers=min(concurrency, max(len(batch.items), 1)),
                                  thread_name_prefix="seqstate-run-batch")
        try:
            for future in [pool.submit(one, i) for i in batch.todo]:
                future.result()
        except BaseException:
            # Ctrl-C: start nothing new, and end the running programs' calls (each raises
            # Interrupted within a poll), so the wait below is short
            batch.interrupt.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            pool.shutdown(wait=True)
    return batch.outcome(return_exceptions)


class _Batch:
    """One run's inputs, results and errors, its checkpoint, progress bar and interrupt: what
    `run_batch` and `arun_batch` share, their per-input bookkeeping in `ended`."""

    def __init__(self, program: Callable, inputs: Iterable[Any], concurrency: int,
                 progress: bool | None, return_exceptions: bool, checkpoint: Any,
                 key: str | None, types: Iterable[type]) -> None:
        self.items = _inputs(program, inputs, concurrency, progress, return_exceptions)
        types = tuple(types)
        if checkpoint is None and (key is not None or types):
            raise ArgumentError("key= and types= name what a checkpoint holds; pass them "
                                "with checkpoint=path")
        if not all(isinstance(t, type) for t in types):
            raise ArgumentError(f"types must be classes (pydantic models, enums), got "
                                f"{types!r:.80}")
        self.results: list[Any] = [None] * len(self.items)
        self.errors: dict[int, BaseException] = {}
        self.lock = threading.Lock()
        # ends the calls of running programs (run on threads, which a cancelled task or a
        # Ctrl-C leaves running)
        self.interrupt = threading.Event()
        self.store = None if checkpoint is None else Checkpoint(
            checkpoint, program, self.items, key=key, types=types)
        done = {} if self.store is None else self.store.finished()
        for i, result in done.items():
            self.results[i] = result
        self.todo = [i for i in range(len(self.items)) if i not in done]
        self.bar = None

    @contextlib.contextmanager
    def running(self, progress: bool | None) -> Iterator[None]:
        """The block with the run's progress bar (resumed inputs counted at once); the
        checkpoint closed when it ends."""
        with progress_bar(progress, len(self.items), "seqstate", "input", call=False) as bar, \
                contextlib.closing(self.store) if self.store is not None \
                else contextlib.nullcontext():
            self.bar = bar
            resumed = len(self.items) - len(self.todo)
            if bar is not None and resumed:
                bar.update(resumed)
                bar.refresh()
            yield

    def ended(self, i: int, outcome: Any) -> None:
        """Input ``i``'s program returned ``outcome`` or raised it (an `Exception`): keep it,
        store a result in the checkpoint, count it."""
        with self.lock:
            self.results[i] = outcome
            if isinstance(outcome, Exception):
                self.errors[i] = outcome
        # once the run is interrupted, a result may be a program's stand-in for the call that
        # raised Interrupted (or it swallowed its cancellation): a rerun runs the input again
        if not isinstance(outcome, Exception) and self.store is not None \
                and not self.interrupt.is_set():
            self.store.put(i, outcome)               # CheckpointError: the run stops
        if self.bar is not None:
            self.bar.update(1)

    def outcome(self, return_exceptions: bool) -> list[Any]:
        """The results in input order; `BatchError` where some failed and
        ``return_exceptions`` is False."""
        if self.errors and not return_exceptions:
            raise BatchError(self.results, self.errors)
        return self.results


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


async def arun_batch(program: Callable[[Any], Any], inputs: Iterable[Any], *,
                     concurrency: int = 16, progress: bool | None = None,
                     return_exceptions: bool = True,
                     checkpoint: str | os.PathLike | None = None, key: str | None = None,
                     types: Iterable[type] = ()) -> list[Any]:
    """`run_batch` from a running event loop: ``await ss.arun_batch(program, inputs)``.

    ``program`` is an ``async def`` function of one input (its generator calls are
    ``await gen.acall(...)``: no thread per input), or a plain function (run on a thread,
    as `run_batch` runs it).  The same rules as `run_batch`: results in input order,
    ``concurrency`` programs in flight, a progress bar, a failed input's exception in its
    place (or `BatchError` with ``return_exceptions=False``), ``checkpoint=``,
    ``key=`` and ``types=``.  Cancelling
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
    batch = _Batch(program, inputs, concurrency, progress, return_exceptions, checkpoint, key,
                   types)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            try:
                with quiet_calls(), interruptible(batch.interrupt):
                    if inspect.iscoroutinefunction(program):
                        out = await program(batch.items[i])
                    else:
                        out = await asyncio.to_thread(program, batch.items[i])
                    result = await out if inspect.isawaitable(out) else out
            except Exception as exc:                 # noqa: BLE001 - reported per input
                batch.ended(i, exc)
            else:
                batch.ended(i, result)

    with batch.running(progress):
        tasks = [asyncio.ensure_future(one(i)) for i in batch.todo]
        try:
            await asyncio.gather(*tasks)
        finally:
            batch.interrupt.set()
            for task in tasks:
                task.cancel()
    return batch.outcome(return_exceptions)
