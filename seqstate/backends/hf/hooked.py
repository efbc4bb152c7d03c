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
its row each column is (-1: padding).  Attention weights (``attn.hook_pattern``) are laid out
over key positions instead of key columns, ``(rows, columns, heads, key positions)``; a
forward that reads them runs with eager attention, the one implementation that forms them.
"""

from __future__ import annotations

import contextlib
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


def _pattern_hook(point: HookPoint, capture: dict[str, torch.Tensor], keys: torch.Tensor,
                  padding: torch.Tensor, owner: int) -> Callable:
    """The torch hook of an attention layer's weights ``(rows, heads, columns, key columns)``:
    kept as ``(rows, columns, heads, key positions)`` (``keys``: each key column's position,
    -1 for padding; 0 where a row has no such key, and in ``padding`` query columns)."""

    def hook(module, args, output):
        if threading.get_ident() != owner:
            return None
        weights = output[1]                                                # (R, H, T, P+T)
        rows, heads, cols, _ = weights.shape
        out = weights.new_zeros(rows, cols, heads, int(keys.max()) + 1)     # (R, T, H, L)
        for i in range(rows):
            valid = keys[i] >= 0
            out[i, :, :, keys[i, valid]] = weights[i][:, :, valid].transpose(0, 1)
        out[padding] = 0
        capture[point.name] = out
        return None

    setattr(hook, SCRATCH_HOOK, True)
    return hook


@contextlib.contextmanager
def _eager(hf_model: Any, wanted: bool):
    """Eager attention for the length of the block where ``wanted``: the fused kernels never
    form the attention weights."""
    before = hf_model.config._attn_implementation
    if not wanted or before == "eager":
        yield
        return
    hf_model.set_attn_implementation("eager")
    try:
        yield
    finally:
        hf_model.set_attn_implementation(before)


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
    keys = torch.full((len(rows), past + width), -1, dtype=torch.long, device=device)  # (R, P+T)
    for i, (h, tail) in enumerate(zip(handles, tails)):
        buf.load(i, h, past)
        ids[i, width - len(tail):] = torch.tensor(tail, dtype=torch.long, device=device)
        pos[i, width - len(tail):] = torch.arange(h.length, h.length + len(tail), device=device)
        keys[i, past - h.length: past] = torch.arange(h.length, device=device)
        keys[i, past + width - len(tail):] = pos[i, width - len(tail):]
    mask = (keys >= 0).long()                                                      # (R, P+T)
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
        if point.pattern:
            hook = _pattern_hook(point, captured, keys, pos < 0, owner)
            registered.append(point.module.register_forward_hook(hook))
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
        with _eager(backend.hf_model, any(p.pattern and p.name in capture for p in points)):
            logits = backend.forward(ids, None if plain else mask, pos, as_cache(buf),
                                     logits=keep_cols, scratch=True)               # (R, K, V)
    finally:
        for handle in registered:
            handle.remove()
    backend.count(prefill_tokens=sum(len(t) for t in tails),
                  cached_tokens_reused=sum(positions.computed))
    return Hooked([logits[i, most - r:] for i, r in enumerate(reads)], captured, positions)
