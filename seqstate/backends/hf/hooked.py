"""A hooked forward over stored KV: activations read and patched, nothing written.

`run_hooked` runs each row's tokens after its stored prefix (or from a position asked) in
one forward, the stored prefix's KV copied into a scratch buffer: read, never written, and
the KV the forward computes goes with the buffer, so the store is exactly as it was.  Hook
points (`seqstate.backends.hf.hook_points`) get torch hooks for the length of that forward
only; they act on this thread's forward only (another thread's forward through the same
modules passes them by), and the store's guard knows them as seqstate's own.

Rows are right-aligned as in a prefill (`seqstate.backends.hf.prefill.run_tails`): stored KV
right-aligned to the longest, tails left-padded, explicit positions and a 2-D mask with
holes.  So an activation is ``(rows, columns, ...)``, and `Positions` says which position of
its row each column is (-1: padding).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqstate.backends.hf.buffer import KVBuffer
from seqstate.backends.hf.cache import as_cache
from seqstate.backends.hf.guard import SCRATCH_HOOK
from seqstate.backends.hf.hook_points import HookPoint
from seqstate.backends.positions import Positions
from seqstate.errors import ArgumentError

__all__ = ["Hooked", "run_hooked"]

HookFn = Callable[[torch.Tensor, "Positions"], "torch.Tensor | None"]


@dataclasses.dataclass(frozen=True, eq=False)
class Hooked:
    """What `run_hooked` returns: ``logits`` (a float32 ``(reads[i], V)`` per row, its last
    positions'), ``captured`` (name -> ``(rows, columns, ...)`` activation) and ``positions``."""

    logits: list[torch.Tensor]
    captured: dict[str, torch.Tensor]
    positions: Positions


def _hook(point: HookPoint, fns: Sequence[HookFn], capture: dict[str, torch.Tensor] | None,
          positions: Positions, owner: int) -> Callable:
    """The torch hook of ``point``: view the activation, run ``fns`` in turn (each returns a
    replacement or None after editing in place), keep a copy in ``capture``."""

    def apply(value: torch.Tensor) -> torch.Tensor:
        act = value if point.heads is None else value.unflatten(-1, (point.heads, -1))
        for fn in fns:
            out = fn(act, positions)
            if out is not None:
                if out.shape != act.shape:
                    raise ArgumentError(f"the hook on {point.name!r} returned shape "
                                        f"{tuple(out.shape)} for an activation of shape "
                                        f"{tuple(act.shape)}: return the same shape, or None "
                                        f"after editing it in place")
                act = out.to(act.dtype)
        if capture is not None:
            capture[point.name] = act.clone()
        return act if point.heads is None else act.flatten(-2)

    if point.input:
        def hook(module, args, kwargs):
            if threading.get_ident() != owner:
                return None
            if args:
                return (apply(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": apply(kwargs["hidden_states"])}
    else:
        def hook(module, args, output):
            if threading.get_ident() != owner:
                return None
            if isinstance(output, tuple):
                return (apply(output[0]), *output[1:])
            return apply(output)
    setattr(hook, SCRATCH_HOOK, True)
    return hook


def run_hooked(backend: Any, rows: Sequence[Sequence[int]], starts: Sequence[int],
               reads: Sequence[int], points: Sequence[HookPoint],
               hooks: dict[str, Sequence[HookFn]], capture: Sequence[str]) -> Hooked:
    """One forward over every row from its start, hooked; the store is never written.

    Row ``i``'s positions from ``starts[i]`` on are computed, and those before it that the
    store lacks (its KV of ``row[:starts[i]]`` is read for as far as the store has it).
    ``reads[i]`` (at most ``len(row) - starts[i]``): the row's last positions whose logits
    are returned.  ``points`` resolves every name of ``hooks`` and ``capture``.
    """
    handles = [backend.store.match(row, start) for row, start in zip(rows, starts)]
    tails = [row[h.length:] for row, h in zip(rows, handles)]
    past, width = max(h.length for h in handles), max(len(t) for t in tails)
    buf = KVBuffer(backend.num_layers, backend.kv_heads, backend.head_dim, len(rows),
                   past + width, backend.dtype, backend.device)
    device = backend.device
    ids = torch.full((len(rows), width), backend.pad_token_id, dtype=torch.long,
                     device=device)                                                # (R, T)
    pos = torch.full((len(rows), width), -1, dtype=torch.long, device=device)      # (R, T)
    mask = torch.zeros(len(rows), past + width, dtype=torch.long, device=device)   # (R, P+T)
    for i, (h, tail) in enumerate(zip(handles, tails)):
        buf.load(i, h, past)
        ids[i, width - len(tail):] = torch.tensor(tail, dtype=torch.long, device=device)
        pos[i, width - len(tail):] = torch.arange(h.length, h.length + len(tail), device=device)
        mask[i, past - h.length: past] = 1
        mask[i, past + width - len(tail):] = 1
    buf.length = past
    del handles
    positions = Positions(pos, tuple(len(r) - len(t) for r, t in zip(rows, tails)),
                          tuple(len(r) for r in rows))
    captured: dict[str, torch.Tensor] = {}
    owner = threading.get_ident()
    # one torch hook per (module, input/output) and name: a name's patches, then its capture
    registered = []
    for point in points:
        fns = list(hooks.get(point.name, ()))
        keep = captured if point.name in capture else None
        if not fns and keep is None:
            continue
        hook = _hook(point, fns, keep, positions, owner)
        if point.input:
            registered.append(point.module.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            registered.append(point.module.register_forward_hook(hook))
    most = max(reads)
    keep_cols = torch.arange(width - most, width, device=device).expand(len(rows), most)  # (R, K)
    try:
        plain = int(mask.sum()) == mask.numel()
        logits = backend.forward(ids, None if plain else mask, pos, as_cache(buf),
                                 logits=keep_cols, scratch=True)                   # (R, K, V)
    finally:
        for handle in registered:
            handle.remove()
    backend.count(prefill_tokens=sum(len(t) for t in tails),
                  cached_tokens_reused=sum(positions.computed))
    return Hooked([logits[i, most - r:] for i, r in enumerate(reads)], captured, positions)
