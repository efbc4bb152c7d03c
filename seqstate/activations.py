"""Activations on states: read them (``state.run_with_cache``) and patch them
(``state.with_hooks``, ``hooks=`` on ``next_logprobs`` and ``score``).

A hooked run computes a state's rows from the end of their stored prefix on (or from the
position ``start=`` asks), over the stored prefix's KV: read, never written, and what the
run computes is never stored, so clean calls afterwards give exactly what they gave before.
Interpretability sweeps over one long shared prefix (activation patching, ACDC) so feed the
prefix once, however many patched runs follow.  Names are TransformerLens-style
(``"blocks.3.hook_resid_post"``, ``"blocks.0.attn.hook_z"``, ...) where the model's layers map
cleanly, or module paths of ``model.hf_model`` (``"model.layers.3.mlp"``): see
`seqstate.backends.hf.hook_points`.  ``"blocks.{i}.attn.hook_pattern"`` reads a layer's
attention weights, ``(rows, columns, heads, key positions)``: they are read only, and a run
that reads them computes its attention eagerly (equal to the fused kernels' to fp32 noise,
slower, and the weights take ``rows x columns x heads x length`` floats a layer).

An activation is ``(rows, columns, ...)``: the state's rows batch-major (as ``list(state)``),
one column per computed position, left-padded; `Positions` says which position each column
is.  A hook ``fn(act, pos)`` edits ``act`` in place or returns a replacement; ``pos.at(p)``
is the mask of position ``p``, so a position patch is one line, and asking for a position
of the stored prefix raises `seqstate.PrefixPositionError` saying how to compute it.

Only engines with the ``activations`` capability run these (hf); the others refuse with
`seqstate.CapabilityError` before any compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from seqstate import scores
from seqstate.backends.base import Scored
from seqstate.backends.positions import Positions
from seqstate.engine.logprob_jobs import BackendJob
from seqstate.errors import ArgumentError, HookNameError
from seqstate.sampling.functions import check_logprobs

__all__ = ["ActivationCache", "HookedState", "Positions", "run_with_cache", "next_logprobs",
           "score"]

Hooks = Mapping[str, Callable | Sequence[Callable]]


@dataclasses.dataclass(frozen=True, eq=False)
class ActivationCache(Mapping):
    """Activations of the positions a run computed, by name, and the log-probs it gave.

    ``cache[name]`` is ``(rows, columns, ...)`` (rows batch-major, columns left-padded);
    ``positions`` says which position each column is (``positions.tensor``, -1 for padding;
    ``positions.computed``: each row's first computed position); ``logprobs`` is the
    next-token log-softmax after every row, ``(batch, samples, vocab)`` float32, as
    ``state.next_logprobs()`` gives.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> story = ss.from_tokens(model, [model.encode("When Mary and John went")])
    >>> _ = story.next_logprobs()                        # stores the story's KV
    >>> names = ["blocks.1.hook_resid_post"]
    >>> cache = (story + " to the store").run_with_cache(names)
    >>> cache.positions.computed == (len(story.rows[0].tokens),)   # read
    True
    >>> suffix = len(model.encode(" to the store"))
    >>> cache["blocks.1.hook_resid_post"].shape[:2] == (1, suffix)
    True
    >>> cache.at("blocks.1.hook_resid_post", -1).shape     # each row's last
    torch.Size([1, 64])
    """

    activations: dict[str, torch.Tensor]
    positions: Positions
    logprobs: torch.Tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.activations[name]
        except KeyError:
            raise HookNameError(f"this cache holds no {name!r}: it holds "
                                f"{', '.join(map(repr, self.activations))}; ask for it in "
                                f"run_with_cache([...])") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.activations)

    def __len__(self) -> int:
        return len(self.activations)

    def at(self, name: str, position: int) -> torch.Tensor:
        """``name``'s activation at ``position`` of every row (negative: from each row's
        end), ``(rows, ...)``; `seqstate.PrefixPositionError` for a position the run did
        not compute (pass ``start=`` to the run)."""
        return self[name][self.positions.at(position)]


@dataclasses.dataclass(frozen=True, eq=False)
class HookedState:
    """A state with hooks to run: ``state.with_hooks(hooks)``.  Each method runs the
    state's rows hooked over their stored prefix, nothing stored (see the module).

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> story = ss.from_tokens(model, [model.encode("When Mary and John went")])
    >>> _ = story.next_logprobs()              # the clean prefix, stored
    >>> def zero_last(act, pos):
    ...     act[pos.at(-1)] = 0                # each row's last position
    >>> hooks = {"blocks.0.hook_mlp_out": zero_last}
    >>> patched = (story + " to").with_hooks(hooks)
    >>> patched.next_logprobs().shape[:2]
    torch.Size([1, 1])
    """

    state: Any
    hooks: Hooks
    start: int | None = None

    def next_logprobs(self) -> torch.Tensor:
        """Float32 ``(batch, samples, vocab)`` next-token log-softmax, hooked."""
        return next_logprobs(self.state, self.hooks, start=self.start)

    def score(self, continuations: Any) -> scores.Scores:
        """``state.score(continuations)``, hooked: one forward row per (row, option) pair,
        rows in order, each row's options in order."""
        return score(self.state, continuations, self.hooks, start=self.start)

    def run_with_cache(self, names: Sequence[str]) -> ActivationCache:
        """Activations of ``names`` with the hooks on (a name's hooks run before its copy)."""
        return run_with_cache(self.state, names, hooks=self.hooks, start=self.start)


def _check(model: Any, feature: str, hooks: Hooks, names: Sequence[str],
           start: int | None) -> dict[str, list[Callable]]:
    """Before any compute: the capability, the start, every name (resolved on the model)
    and every hook; the hooks as lists per name."""
    model.backend.capabilities.require(
        "activations", feature, "load the model on the hf engine "
        "(ss.models.transformers(...)) to read or patch activations", model.name)
    if start is not None and (not isinstance(start, int) or isinstance(start, bool)
                              or start < 0):
        raise ArgumentError(f"start is the first position to compute, an int >= 0 (0: the "
                            f"whole sequence, a full forward), or None; got {start!r}")
    if not isinstance(hooks, Mapping):
        raise ArgumentError(f"hooks is a dict {{name: fn}} (or {{name: [fn, ...]}}), got "
                            f"{hooks!r}")
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ArgumentError(f"names is a list of activation names, got {names!r}")
    listed = {name: list(fn) if isinstance(fn, (list, tuple)) else [fn]
              for name, fn in hooks.items()}
    for name, fns in listed.items():
        bad = [fn for fn in fns if not callable(fn)]
        if bad:
            raise ArgumentError(f"the hook on {name!r} is {bad[0]!r}: give a function "
                                f"fn(act, pos) that edits act in place or returns a tensor")
    points = model.backend.hook_points([*listed, *names])
    patched = [p.name for p in points[:len(listed)] if p.pattern]
    if patched:
        raise ArgumentError(f"{patched[0]!r} is read only: attention weights are copied as "
                            f"the layer forms them, not fed back; patch the heads' outputs "
                            f"(attn.hook_z) or the layer's input (hook_resid_pre) instead")
    return listed


def _run(model: Any, rows: list[tuple[int, ...]], starts: list[int], reads: list[int],
         hooks: dict[str, list[Callable]], capture: Sequence[str]):
    """The hooked forward on the model's worker, between other calls' steps."""
    job = BackendJob(lambda backend: backend.run_hooked(rows, starts, reads, hooks,
                                                       list(capture)))
    return model.runner.run_job(job)


def _starts(rows: Sequence[Sequence[int]], start: int | None) -> list[int]:
    """Each row's first position to compute: at most its last token."""
    return [len(r) - 1 if start is None else min(start, len(r) - 1) for r in rows]


def run_with_cache(state: Any, names: Sequence[str], *, hooks: Hooks | None = None,
                   start: int | None = None) -> ActivationCache:
    """``state.run_with_cache(names)``: see `ActivationCache`."""
    listed = _check(state.model, "state.run_with_cache()", hooks or {}, names, start)
    rows = scores.row_prefixes(state.model, [r.tokens for r in state.rows])
    done = _run(state.model, rows, _starts(rows, start), [1] * len(rows), listed, names)
    logprobs = torch.stack([check_logprobs(lg[-1].log_softmax(-1)) for lg in done.logits])
    return ActivationCache({n: done.captured[n] for n in dict.fromkeys(names)},
                           done.positions, logprobs.view(*state.shape, -1))


def next_logprobs(state: Any, hooks: Hooks, *, start: int | None = None) -> torch.Tensor:
    """``state.next_logprobs(hooks=...)``: ``(batch, samples, vocab)``, hooked."""
    listed = _check(state.model, "state.next_logprobs(hooks=...)", hooks, [], start)
    rows = scores.row_prefixes(state.model, [r.tokens for r in state.rows])
    done = _run(state.model, rows, _starts(rows, start), [1] * len(rows), listed, [])
    out = torch.stack([check_logprobs(lg[-1].log_softmax(-1)) for lg in done.logits])
    return out.view(*state.shape, -1)


def score(state: Any, continuations: Any, hooks: Hooks, *, start: int | None = None,
          store: bool = False) -> scores.Scores:
    """``state.score(continuations, hooks=...)``: each (row, option) pair one row of one
    hooked forward."""
    if store:
        raise ArgumentError("store=True keeps continuations' KV, and KV computed through "
                            "hooks is never stored: drop one of store= and hooks=")
    listed = _check(state.model, "state.score(..., hooks=...)", hooks, [], start)

    def scorer(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Scored]:
        rows = [tuple(p) + tuple(c[:-1]) for p, c in pairs]
        starts = [min(s, len(p) - 1) for s, (p, _) in zip(_starts(rows, start), pairs)]
        done = _run(state.model, rows, starts, [len(c) for _, c in pairs], listed, [])
        out = []
        for logits, (_, c) in zip(done.logits, pairs):
            logprobs = check_logprobs(logits.log_softmax(-1))                    # (len(c), V)
            targets = torch.tensor(c, device=logprobs.device)
            got = logprobs.gather(1, targets[:, None])[:, 0]
            out.append(Scored(tuple(got.tolist()),
                              tuple((logprobs.argmax(-1) == targets).tolist())))
        return out

    return scores.score(state.model, [r.tokens for r in state.rows], state.shape,
                        continuations, scorer=scorer)
