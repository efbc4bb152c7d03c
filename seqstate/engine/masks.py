"""The step's constrain stage: which tokens each row may take next, and logits masked by it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from seqstate.constraints import bitmask
from seqstate.engine.rows import LiveRow

__all__ = ["allowed_mask", "allowed_masks", "packed_masks", "constrained"]


def allowed_mask(row: LiveRow, vocab_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Bool mask (V,) of the row's allowed tokens (constraint and bans), or None when anything goes."""
    banned = row.bans.get(len(row.tokens))
    if row.cursor is None and not banned:
        return None
    mask = torch.ones(vocab_size, dtype=torch.bool, device=device)        # (V,)
    if row.cursor is not None:
        allowed = row.cursor.allowed()                                      # (V_tok,)
        mask[: allowed.shape[0]] = allowed
        mask[allowed.shape[0]:] = False
    if banned:
        mask[list(banned)] = False
    return mask


def packed_masks(rows: Sequence[LiveRow], vocab_size: int) -> np.ndarray | None:
    """Every row's `allowed_mask` packed (`seqstate.constraints.bitmask`): int32 (B, W), or
    None when no row is constrained or banned.  A row whose words are all zero allows nothing.

    Cursors of one kind fill their rows together (`Cursor.fill`: llguidance fills a batch's
    bitmasks in parallel, into this form); bans clear their bits.
    """
    cursors = [r.cursor for r in rows]
    bans = [r.bans.get(len(r.tokens)) for r in rows]
    if all(c is None for c in cursors) and not any(bans):
        return None
    out = np.empty((len(rows), bitmask.words(vocab_size)), dtype=np.int32)           # (B, W)
    free = [j for j, c in enumerate(cursors) if c is None]
    if free:
        out[free] = -1                                  # every other row is its cursor's
    kinds: dict[type, tuple[list, list[int]]] = {}
    for j, c in enumerate(cursors):
        if c is not None:
            group, at = kinds.setdefault(type(c), ([], []))
            group.append(c)
            at.append(j)
    for kind, (group, at) in kinds.items():
        kind.fill(group, out, at)
    for j, banned in enumerate(bans):
        if banned:
            bitmask.set_bits(out[j], sorted(banned), False)
    bitmask.trim(out, vocab_size)
    return out


def allowed_masks(rows: Sequence[LiveRow], vocab_size: int,
                  device: torch.device) -> torch.Tensor | None:
    """Bool masks (B, V) on ``device``: every row's `allowed_mask` at once (`packed_masks`,
    unpacked on ``device``), or None when no row is constrained or banned."""
    packed = packed_masks(rows, vocab_size)
    return None if packed is None else bitmask.unpack(packed, vocab_size, device)


def constrained(logits: torch.Tensor, allowed: torch.Tensor, finite: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` where ``allowed`` (bool, same shape), -inf elsewhere, written to ``out`` (a
    tensor like ``logits``; a new one when None).

    With ``finite`` logits (no NaN anywhere) this is the minimum of the logits and a
    +inf/-inf bias made from the mask: arithmetic the CPU vectorizes, where ``torch.where``
    on a bool mask does not.  Otherwise it is ``torch.where``, which keeps a NaN from leaking
    out of a disallowed token.
    """
    if out is None:
        out = torch.empty_like(logits)
    if not finite:
        return out.copy_(torch.where(allowed, logits, float("-inf")))
    bias = out.copy_(allowed.view(torch.uint8)).sub_(0.5).mul_(float("inf"))     # +-inf
    return torch.minimum(logits, bias, out=out)
