"""Frozen sampler objects.  Each travels whole; override fields with ``dataclasses.replace``."""

from __future__ import annotations

import dataclasses
import numbers
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from seqstate.errors import ArgumentError
from seqstate.sampling.functions import (filter_min_p, filter_top_k, filter_top_p,
                                         greedy_tokens, presence_frequency_penalty, race_sample,
                                         repetition_penalty)

__all__ = ["Sampler", "Greedy", "Multinomial", "BeamSearch", "greedy", "multinomial", "beam_search"]


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


History = Sequence[tuple[Sequence[int], int]]     # per row: (its tokens, where this call began)


class Sampler(ABC):
    """Chooses one token per row from constrained logits (B, V); -inf marks banned tokens.

    Attributes
    ----------
    needs_history : bool
        Whether `choose` needs the rows' tokens (``history``); the engine passes them only
        then.  False by default.
    """

    __slots__ = ()
    needs_history: bool = False

    @abstractmethod
    def choose(self, logits: torch.Tensor, rng: torch.Generator | None,
               history: History | None = None) -> torch.Tensor:
        """One token id per row (B,).  ``history[b]`` is row ``b``'s ``(tokens, start)``,
        ``tokens[start:]`` being what this call generated (given when ``needs_history``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Greedy(Sampler):
    """Always the most likely allowed token.

    Examples
    --------
    >>> import seqstate as ss
    >>> ss.greedy()
    Greedy()
    """

    def choose(self, logits: torch.Tensor, rng: torch.Generator | None,
               history: History | None = None) -> torch.Tensor:
        return greedy_tokens(logits)


@dataclasses.dataclass(frozen=True, slots=True)
class Multinomial(Sampler):
    """Ancestral sampling with penalties, temperature, then top-k, top-p and min-p filtering.

    Applied in Hugging Face's order: ``repetition_penalty`` (over every token of the row,
    prompt included, as ``RepetitionPenaltyLogitsProcessor``), ``presence_penalty`` and
    ``frequency_penalty`` (over the tokens this call generated, as OpenAI, vLLM and SGLang
    define them), then temperature, top-k, top-p and min-p.  Stored log-probs stay the
    model's own; the adjustments only decide which token is drawn.

    Examples
    --------
    >>> import seqstate as ss
    >>> sampler = ss.multinomial(temperature=0.7, top_p=0.9, repetition_penalty=1.2)
    >>> sampler.top_p, sampler.repetition_penalty, sampler.needs_history
    (0.9, 1.2, True)
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not self.temperature > 0:
            raise ArgumentError(f"temperature must be a number > 0, got {self.temperature!r}; "
                                "use ss.greedy() for deterministic decoding")
        if self.top_k is not None and not (_is_int(self.top_k) and self.top_k >= 1):
            raise ArgumentError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ArgumentError(f"top_p must be a number in (0, 1] or None, got {self.top_p!r}")
        if self.min_p is not None and not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise ArgumentError(f"min_p must be a number in [0, 1] or None, got {self.min_p!r}")
        if not _is_real(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ArgumentError(f"repetition_penalty must be a number > 0 (1.0: none), got "
                                f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or abs(value) == float("inf"):
                raise ArgumentError(f"{name} must be a finite number (0.0: none), got {value!r}")

    @property
    def needs_history(self) -> bool:
        """Whether `choose()` needs the rows' tokens (a penalty is set)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def warp(self, logits: torch.Tensor, history: History | None = None) -> torch.Tensor:
        """The logits ``choose`` draws from; ``history[b]`` is row ``b``'s ``(tokens, start)``,
        ``tokens[start:]`` being what this call generated."""
        if self.needs_history:
            if history is None:
                raise ArgumentError("penalties need each row's tokens: pass history")
            if self.repetition_penalty != 1.0:
                seen = [torch.as_tensor(list(t), dtype=torch.long, device=logits.device)
                        for t, _ in history]
                logits = repetition_penalty(logits, seen, self.repetition_penalty)
            if self.presence_penalty or self.frequency_penalty:
                new = [torch.as_tensor(list(t[start:]), dtype=torch.long, device=logits.device)
                       for t, start in history]
                logits = presence_frequency_penalty(logits, new, self.presence_penalty,
                                                    self.frequency_penalty)
        logits = logits / self.temperature
        if self.top_k is not None:
            logits = filter_top_k(logits, self.top_k)
        if self.top_p is not None:
            logits = filter_top_p(logits, self.top_p)
        if self.min_p:
            logits = filter_min_p(logits, self.min_p)
        return logits

    def choose(self, logits: torch.Tensor, rng: torch.Generator | None,
               history: History | None = None) -> torch.Tensor:
        return race_sample(self.warp(logits, history), rng)


@dataclasses.dataclass(frozen=True, slots=True)
class BeamSearch(Sampler):
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

    def choose(self, logits: torch.Tensor, rng: torch.Generator | None,
               history: History | None = None) -> torch.Tensor:
        """Per-row choice is the best token; the beam engine uses `score()` instead."""
        return greedy_tokens(logits)

    def score(self, weight: float, length: int) -> float:
        return weight / max(length, 1) ** self.length_penalty if self.length_penalty else weight


def greedy() -> Greedy:
    """The greedy sampler."""
    return Greedy()


def beam_search(width: int, length_penalty: float = 0.0, early_stopping: bool = True) -> BeamSearch:
    """A beam-search sampler of ``width`` beams (see `BeamSearch`)."""
    return BeamSearch(width, length_penalty, early_stopping)


def multinomial(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                min_p: float | None = None, repetition_penalty: float = 1.0,
                presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> Multinomial:
    """A multinomial sampler (see `Multinomial` for what each option does)."""
    return Multinomial(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                       frequency_penalty)
