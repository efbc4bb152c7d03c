"""The step's constrain stage: which tokens each row may take next, and logits masked by it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqstate.engine.rows import LiveRow

__all__ = ["allowed_mask", "allowed_masks", "constrained"]


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


def allowed_masks(rows: Sequence[LiveRow], vocab_size: int,
                  device: torch.device) -> torch.Tensor | None:
    """Bool masks (B, V) on ``device``: every row's `allowed_mask` at once, or None when no row
    is constrained or banned.

    Cursors of one kind compute their masks together (`Cursor.prepare`: llguidance fills
    a batch's bitmasks in parallel); the masks, cached on the CPU by their constraints, are
    stacked and moved to ``device`` in one copy.
    """
    cursors = [r.cursor for r in rows]
    bans = [r.bans.get(len(r.tokens)) for r in rows]
    constrained_rows = [j for j, c in enumerate(cursors) if c is not None]
    if not constrained_rows and not any(bans):
        return None
    kinds: dict[type, list] = {}
    for c in cursors:
        if c is not None:
            kinds.setdefault(type(c), []).append(c)
    for kind, group in kinds.items():
        kind.prepare(group)
    parts = [cursors[j].allowed() for j in constrained_rows]                   # (V_tok,) each
    if len(constrained_rows) == len(rows) and all(p.shape[0] == vocab_size for p in parts):
        mask = torch.stack(parts).to(device, non_blocking=True)                    # (B, V)
    else:
        mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)  # (B, V)
        for j, part in zip(constrained_rows, parts):
            mask[j, : part.shape[0]] = part.to(device, non_blocking=True)
            mask[j, part.shape[0]:] = False
    for j, banned in enumerate(bans):
        if banned:
            mask[j, torch.tensor(sorted(banned), dtype=torch.long, device=device)] = False
    return mask


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
