"""Frozen sampler objects.  Each travels whole; override fields with ``dataclasses.replace``."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Protocol, runtime_checkable

import torch

from seqstate.sampling.functions import (filter_top_k, filter_top_p, greedy_tokens,
                                         race_sample)

from seqstate.errors import ArgumentError

__all__ = ["Sampler", "Greedy", "Multinomial", "BeamSearch", "greedy", "multinomial", "beam_search"]


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


@runtime_checkable
class Sampler(Protocol):
    """Chooses one token per row from constrained logits (B, V); -inf marks banned tokens."""

    def choose(self, logits: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Greedy:
    """Always the most likely allowed token.

    Examples
    --------
    >>> import seqstate as ss
    >>> ss.greedy()
    Greedy()
    """

    def choose(self, logits: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor:
        return greedy_tokens(logits)


@dataclasses.dataclass(frozen=True, slots=True)
class Multinomial:
    """Ancestral sampling with temperature, then optional top-k and nucleus (top-p) filtering.

    Examples
    --------
    >>> import seqstate as ss
    >>> ss.multinomial(temperature=0.7, top_p=0.9)
    Multinomial(temperature=0.7, top_k=None, top_p=0.9)
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not self.temperature > 0:
            raise ArgumentError(f"temperature must be a number > 0, got {self.temperature!r}; "
                                "use ss.greedy() for deterministic decoding")
        if self.top_k is not None and not (_is_int(self.top_k) and self.top_k >= 1):
            raise ArgumentError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ArgumentError(f"top_p must be a number in (0, 1] or None, got {self.top_p!r}")

    def choose(self, logits: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor:
        logits = logits / self.temperature
        if self.top_k is not None:
            logits = filter_top_k(logits, self.top_k)
        if self.top_p is not None:
            logits = filter_top_p(logits, self.top_p)
        return race_sample(logits, rng)


@dataclasses.dataclass(frozen=True, slots=True)
class BeamSearch:
    """Beam search over whole programs: keep the ``width`` best continuations by total log-prob.

    A beam is a sample of the state; its weight counts every generated token of the program so
    far, so continuing a beam state with another generator keeps searching jointly.  Finished
    beams are ranked by ``weight / generated_tokens ** length_penalty`` (0 = raw log-prob).
    With ``early_stopping`` a batch item stops once ``width`` beams have finished; otherwise
    it goes on while a live beam could still beat them.

    Examples
    --------
    >>> import seqstate as ss
    >>> ss.beam_search(4)
    BeamSearch(width=4, length_penalty=0.0, early_stopping=True)
    """

    width: int
    length_penalty: float = 0.0
    early_stopping: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.width) or self.width < 1:
            raise ArgumentError(f"beam width must be an int >= 1, got {self.width!r}")

    def choose(self, logits: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor:
        """Per-row choice is the best token; the beam engine uses :meth:`score` instead."""
        return greedy_tokens(logits)

    def score(self, weight: float, length: int) -> float:
        return weight / max(length, 1) ** self.length_penalty if self.length_penalty else weight


def greedy() -> Greedy:
    """The greedy sampler."""
    return Greedy()


def beam_search(width: int, length_penalty: float = 0.0, early_stopping: bool = True) -> BeamSearch:
    """A beam-search sampler of ``width`` beams (see :class:`BeamSearch`)."""
    return BeamSearch(width, length_penalty, early_stopping)


def multinomial(temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> Multinomial:
    """A multinomial sampler with temperature, top-k and top-p."""
    return Multinomial(temperature, top_k, top_p)
