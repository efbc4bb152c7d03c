"""What a model's calls ask of its engine: the `Runner` protocol.

A model has one runner (``model.runner``), picked by its backend's kind: the
`seqstate.engine.scheduler.Scheduler` on an engine that steps rows (concurrent calls share
decode steps), the `seqstate.engine.requests.RequestRunner` on a server (each row a
request).  Generators, option scoring and states reach the engine only through these six
methods, so they run the same on every engine; tests/test_runner.py holds every runner to
these exact signatures.
"""

from __future__ import annotations

import functools

from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from seqstate.backends.base import Handle, Scored
from seqstate.engine.rows import Decoding, LiveRow, RowRequest, RowResult
from seqstate.engine.waiting import Caller
from seqstate.errors import ModelClosed
from seqstate.sampling.params import BeamSearch

__all__ = ["Runner", "ClosedRunner", "unobserved"]


def unobserved(rows: list[LiveRow]) -> tuple[()]:
    """``run``'s default ``observe``: nothing to deliver after a step."""
    return ()


@runtime_checkable
class Runner(Protocol):
    """The engine side of a model's calls: decode, beam search, scoring, stored prefixes.

    Examples
    --------
    >>> import seqstate as ss
    >>> from seqstate.engine.runner import Runner
    >>> isinstance(ss.models.testing.tiny().runner, Runner)
    True
    """

    def run(self, requests: Sequence[RowRequest], decoding: Decoding = Decoding(),
            observe: Callable[[list[LiveRow]], Sequence[Any]] = unobserved,
            caller: Caller | None = None) -> Generator[Any, None, list[RowResult]]:
        """Continue every row as ``decoding`` says (its sampler, RNG, hooks; its
        ``speculate``: verify the tokens a constraint forces in one forward, where the
        engine can); yields what ``observe`` returns as the rows advance, returns one result
        per row.  ``caller``: its deadline (past it, `CallTimeout`), and whether it awaits in
        an event loop (then `PAUSE` is yielded while there is nothing new); None: a thread's
        call with no deadline, built when the call starts, so the program run it belongs to
        may interrupt it (`seqstate.engine.waiting.interruptible`).  Closing the generator
        early ends the call's rows at the engine's next step."""
        ...

    def generate(self, requests: Sequence[RowRequest], decoding: Decoding = Decoding()
                 ) -> list[RowResult]:
        """`run` to its end: the results."""
        ...

    def beam(self, groups: Sequence[Sequence[tuple[RowRequest, float, int]]],
             params: BeamSearch, on_step: Callable[[], None] | None = None,
             caller: Caller | None = None
             ) -> Generator[Any, None, list[list[tuple[RowResult, float, int]]]]:
        """Beam-search each group (one batch item's incoming beams: request, weight,
        length).  Returns, per group, up to ``width`` ``(result, score, origin)`` triples
        sorted best-first; ``origin`` is the index of the incoming beam (within its group)
        the result descends from.  ``on_step`` runs after every step.  ``caller`` as in
        `run`; the search yields nothing else."""
        ...

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
              store: bool = False) -> list[Scored]:
        """Teacher-forced log-probs of each pair's continuation after its prefix."""
        ...

    def next_logprobs(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Float32 log-softmax ``(len(rows), V)`` of the next token after each row."""
        ...

    def stored(self, rows: Sequence[Sequence[int]]) -> list[Handle]:
        """Handles on the KV of each ``row[:-1]``."""
        ...


def _refusing(method: Callable) -> Callable:
    """``method`` of a closed model's runner: its signature, and `ModelClosed` at once."""

    @functools.wraps(method)
    def refuse(self: ClosedRunner, *args: Any, **kwargs: Any) -> Any:
        raise ModelClosed(f"model {self.name!r} was closed (model.close()); load it again to "
                          "run more calls")
    return refuse


class ClosedRunner:
    """The runner of a closed model (``model.close()``): every call raises `ModelClosed`,
    before any compute."""

    def __init__(self, name: str) -> None:
        self.name = name

    run = _refusing(Runner.run)
    generate = _refusing(Runner.generate)
    beam = _refusing(Runner.beam)
    score = _refusing(Runner.score)
    next_logprobs = _refusing(Runner.next_logprobs)
    stored = _refusing(Runner.stored)

    def close(self) -> None:
        """Nothing left to close."""
