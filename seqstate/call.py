"""The keywords of one generator call: declared once, validated before any compute."""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import inspect
import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import torch

from seqstate.detokenize import StopMatcher
from seqstate.engine.rows import Decoding
from seqstate.engine.waiting import Caller
from seqstate.errors import ArgumentError
from seqstate.hooks import DEFAULT_MAX_BACKTRACKS
from seqstate.sampling.params import Greedy, Sampler, _is_int

__all__ = ["Call", "CallOptions", "CALL_PARAMETERS", "DEFAULT_MAX_TOKENS", "MAX_CONSTRAINED_TOKENS"]

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


class CallOptions(TypedDict, total=False):
    """The keywords every generator call takes (``gen(prompt, **call)``, ``gen.stream``,
    ``gen.resume``, ``gen.acall``), typed for IDEs as ``**call: Unpack[CallOptions]``.

    Their defaults and checks live in `Call`; the call methods' signatures show them.
    Any other keyword is an ``ss.ArgumentError`` naming seqstate's spelling of it
    (``max_new_tokens`` -> ``max_tokens``, ``temperature`` ->
    ``ss.multinomial(temperature=...)``).

    Attributes
    ----------
    max_tokens : int or None, default None
        Most new tokens per row.  None: 256 for free text; a constrained call
        runs until its constraint completes, bounded by 4096 tokens (and the
        context).  A row that reaches the bound finishes with ``"max_tokens"``.
    stop_at : str, list of str or None, default None
        Stop a row right after one of these appears in its new text (the state's text keeps
        it; ``value`` does not).
    num_samples : int or None, default None
        Fork each batch item into this many samples; None keeps the state's samples.
    sampler : Sampler, default ss.greedy()
        ``ss.greedy()``, ``ss.multinomial(...)`` or ``ss.beam_search(width)``.
    seed : int or None, default None
        Seed of this call's own random generator (sampled calls are reproducible).
    rng : torch.Generator or None, default None
        A generator to draw from instead of ``seed``.
    hooks : list of callables, default ()
        Post-sampling hooks, called with a ``SampleEvent`` per sampled token (see ``ss.hooks``).
    token_healing : bool, default False
        Back up the prompt's last tokens and let the call re-spell them.
    max_backtracks : int, default 32
        Most rollbacks hooks may ask for per row before it finishes with ``"max_backtracks"``.
    speculate : bool, default True
        Constraint-guided speculation: text a constraint forces is drafted in its canonical
        tokens and verified by the model in one forward, and the sampler still chooses at
        every position.  Greedy output is the same as with False; sampled output has the
        same distribution, but a seeded call with several rows may draw other samples than
        with False, because verifying drafts consumes its RNG in another order (a one-row
        call consumes it in the same order).  False decodes token by token.
    name : str or None, default None
        Record this call's value as a named capture: ``state[name]``.
    progress : bool or None, default None
        A progress bar on standard error: None shows one when it is a terminal and the call
        runs longer than 2 s (``SEQSTATE_PROGRESS=0`` turns it off); True always; False never.
    timeout : float or None, default None
        Seconds the call may take; past them it raises ``ss.CallTimeout`` and its rows leave
        the running batch at the next step, releasing what they held.  None: no limit.
    """

    max_tokens: int | None
    stop_at: str | Sequence[str] | None
    num_samples: int | None
    sampler: Sampler
    seed: int | None
    rng: torch.Generator | None
    hooks: Sequence[Callable]
    token_healing: bool
    max_backtracks: int
    speculate: bool
    name: str | None
    progress: bool | None
    timeout: float | None


CALL_PARAMETERS = "Parameters\n----------\n" + inspect.cleandoc(
    CallOptions.__doc__.split("----------\n", 1)[1])


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
    timeout: float | None = None

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> Call:
        """A call from user keywords; an unknown keyword names seqstate's spelling of it."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in kwargs:
            if name in known:
                continue
            hint = _OTHER_SPELLINGS.get(name)
            if hint is None:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"{close[0]}=" if close else None
            raise ArgumentError(f"unknown keyword {name!r}"
                                + (f"; seqstate spells it {hint}" if hint else "")
                                + f". A generator call takes: {', '.join(sorted(known))}")
        return cls(**kwargs)

    @classmethod
    def parameters(cls) -> list[inspect.Parameter]:
        """The keywords as keyword-only parameters, with their types and defaults: what the
        call methods' signatures show (``help(gen)``, notebooks)."""
        return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                  annotation=f.type) for f in dataclasses.fields(cls)]

    def __post_init__(self) -> None:
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens > 0):
            raise ArgumentError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if self.num_samples is not None and not (_is_int(self.num_samples) and self.num_samples > 0):
            raise ArgumentError(f"num_samples must be a positive int or None, got {self.num_samples!r}")
        if not _is_int(self.max_backtracks) or self.max_backtracks < 0:
            raise ArgumentError(f"max_backtracks must be an int >= 0, got {self.max_backtracks!r}")
        if not isinstance(self.sampler, Sampler):
            raise ArgumentError("sampler must be ss.greedy(), ss.multinomial(...), "
                                "ss.beam_search(...) or a subclass of ss.sampling.Sampler, "
                                f"got {self.sampler!r}")
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
        if self.timeout is not None and not (
                isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool)
                and math.isfinite(self.timeout) and self.timeout > 0):
            raise ArgumentError(f"timeout must be a number of seconds > 0 or None (no limit), "
                                f"got {self.timeout!r}")
        stops = self._stop_list()
        if not all(isinstance(s, str) and s for s in stops):
            raise ArgumentError(f"stop_at must be a non-empty str or a list of them, got {self.stop_at!r}")

    def warn_unused(self) -> None:
        """Warn of keywords the greedy sampler makes pointless.  Called once the call's rows
        are prepared, so that a call refused with an error (``num_samples`` on a state with
        other samples: `SampleMismatch`) shows the error alone, not a warning before it."""
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

    def decoding(self, device: torch.device | str = "cpu") -> Decoding:
        """What the engine needs of this call to decode its rows, as one value: its sampler,
        its random generator (`generator` on ``device``), hooks, backtrack limit and
        speculation."""
        return Decoding(self.sampler, self.generator(device), tuple(self.hooks),
                        self.max_backtracks, self.speculate)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The call's random generator: ``rng`` as given, or one seeded with ``seed`` on
        ``device`` (the model's, where its logits are sampled).  Seeded calls are reproducible
        per device, not across devices: CUDA's generator draws other numbers than the CPU's
        from the same seed (drawing on the CPU and copying would cost a (rows, vocabulary)
        transfer per step)."""
        if self.rng is not None:
            return self.rng
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(int(self.seed))

    def caller(self, loop: asyncio.AbstractEventLoop | None = None) -> Caller:
        """How this call's caller waits: blocking its thread, or awaiting in ``loop``; with
        the call's deadline (``timeout``) from now."""
        return Caller(self.timeout, loop)
