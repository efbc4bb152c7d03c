"""The keywords of one generator call: declared once, validated before any compute."""

from __future__ import annotations

import dataclasses
import difflib
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from seqstate.detokenize import StopMatcher
from seqstate.engine.step import DEFAULT_MAX_BACKTRACKS
from seqstate.errors import ArgumentError
from seqstate.sampling.params import Greedy, Sampler, _is_int

__all__ = ["Call", "DEFAULT_MAX_TOKENS", "MAX_CONSTRAINED_TOKENS"]

DEFAULT_MAX_TOKENS = 256         # free text: new tokens per row when max_tokens is not given
MAX_CONSTRAINED_TOKENS = 4096    # a constrained call runs to completion, but no further

# keywords users bring from Hugging Face, SGLang, vLLM and outlines, and seqstate's spelling
_OTHER_SPELLINGS = {
    "max_new_tokens": "max_tokens=",
    "max_length": "max_tokens= (it counts new tokens only)",
    "stop": "stop_at=",
    "stop_strings": "stop_at=",
    "temperature": "sampler=ss.multinomial(temperature=...)",
    "top_p": "sampler=ss.multinomial(top_p=...)",
    "top_k": "sampler=ss.multinomial(top_k=...)",
    "do_sample": "sampler=ss.multinomial(...) (sampling) or ss.greedy() (the default)",
    "num_beams": "sampler=ss.beam_search(width)",
    "num_return_sequences": "num_samples=",
    "n": "num_samples=",
    "generator": "rng= (a torch.Generator) or seed=",
    "random_seed": "seed=",
}


def _warn(message: str) -> None:
    """A warning pointing at the user's line: the first frame outside seqstate."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("seqstate"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """The keywords of one generator call, declared once and validated before any compute."""

    max_tokens: int | None = None
    stop_at: str | Sequence[str] | None = None
    num_samples: int | None = None
    sampler: Sampler = Greedy()
    seed: int | None = None
    rng: torch.Generator | None = None
    hooks: Sequence[Callable] = ()
    token_healing: bool = False
    max_backtracks: int = DEFAULT_MAX_BACKTRACKS
    speculate: bool = True
    name: str | None = None
    progress: bool | None = None

    @classmethod
    def of(cls, kwargs: Mapping[str, Any], unknown: Mapping[str, Any] = {}) -> Call:
        """A call from user keywords (``kwargs`` may hold other names, e.g. a method's
        ``locals()``: only the call's own are taken); a keyword in ``unknown`` is an error
        that names seqstate's spelling of it."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in unknown:
            hint = _OTHER_SPELLINGS.get(name)
            if hint is None:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"{close[0]}=" if close else None
            raise ArgumentError(f"unknown keyword {name!r}"
                                + (f"; seqstate spells it {hint}" if hint else "")
                                + f". A generator call takes: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in kwargs.items() if k in known})

    def __post_init__(self) -> None:
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens > 0):
            raise ArgumentError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if self.num_samples is not None and not (_is_int(self.num_samples) and self.num_samples > 0):
            raise ArgumentError(f"num_samples must be a positive int or None, got {self.num_samples!r}")
        if not _is_int(self.max_backtracks) or self.max_backtracks < 0:
            raise ArgumentError(f"max_backtracks must be an int >= 0, got {self.max_backtracks!r}")
        if not hasattr(self.sampler, "choose"):
            raise ArgumentError("sampler must be ss.greedy(), ss.multinomial(...) or "
                                f"ss.beam_search(...), got {self.sampler!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ArgumentError(f"seed must be an int, got {self.seed!r}")
        if self.rng is not None and not isinstance(self.rng, torch.Generator):
            raise ArgumentError(f"rng must be a torch.Generator, got {self.rng!r}; "
                                "to seed the call, pass seed= instead")
        if self.seed is not None and self.rng is not None:
            raise ArgumentError("pass seed= or rng=, not both")
        if callable(self.hooks) or isinstance(self.hooks, (str, bytes)) \
                or not isinstance(self.hooks, Sequence):
            raise ArgumentError(f"hooks must be a list of callables, got {self.hooks!r}; "
                                "for one hook write hooks=[hook]")
        if not all(callable(h) for h in self.hooks):
            raise ArgumentError(f"hooks must be callables taking a SampleEvent, got {self.hooks!r}")
        if not isinstance(self.token_healing, bool):
            raise ArgumentError(f"token_healing must be True or False, got {self.token_healing!r}")
        if not isinstance(self.speculate, bool):
            raise ArgumentError(f"speculate must be True or False, got {self.speculate!r}")
        if self.name is not None and not (isinstance(self.name, str) and self.name):
            raise ArgumentError(f"name must be a non-empty str (the capture's name), got {self.name!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ArgumentError(f"progress must be True, False or None (automatic), got {self.progress!r}")
        stops = self._stop_list()
        if not all(isinstance(s, str) and s for s in stops):
            raise ArgumentError(f"stop_at must be a non-empty str or a list of them, got {self.stop_at!r}")
        if isinstance(self.sampler, Greedy):
            if self.seed is not None or self.rng is not None:
                _warn("seed/rng has no effect with the greedy sampler; pass "
                      "sampler=ss.multinomial(...) to sample")
            if self.num_samples is not None and self.num_samples > 1:
                _warn(f"num_samples={self.num_samples} with the greedy sampler gives identical "
                      "copies; pass sampler=ss.multinomial(...) for different samples")

    def _stop_list(self) -> list:
        if self.stop_at is None or isinstance(self.stop_at, str):
            return [] if self.stop_at is None else [self.stop_at]
        if not isinstance(self.stop_at, (list, tuple)):
            raise ArgumentError(f"stop_at must be a str or a list of str, got {self.stop_at!r}")
        return list(self.stop_at)

    @property
    def stops(self) -> StopMatcher | None:
        stops = self._stop_list()
        return StopMatcher(stops) if stops else None

    def generator(self) -> torch.Generator | None:
        if self.rng is not None:
            return self.rng
        return None if self.seed is None else torch.Generator().manual_seed(int(self.seed))
