"""Token masks packed as llguidance packs them: token ``t`` is allowed where bit ``t % 32`` of
int32 word ``t // 32`` is set, a row of ``ceil(V / 32)`` words (32 times smaller than a bool
mask).  The decode step builds its batch's masks in this form and unpacks them once, on the
logits' device.

>>> row = pack(torch.tensor([True, False, True]), words(3))
>>> row.tolist(), has(row, 2), has(row, 1)
([5], True, False)
>>> set_bits(row, [1], True); unpack(row[None], 3).tolist()
[[True, True, True]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["words", "pack", "unpack", "has", "set_bits", "trim"]


def words(size: int) -> int:
    """Words in a packed row of ``size`` tokens."""
    return (size + 31) // 32


def pack(mask: torch.Tensor, n: int) -> np.ndarray:
    """The bool mask ``mask`` (V,) as a packed row of ``n`` words (tokens past V refused)."""
    bits = np.zeros(n * 32, dtype=bool)
    bits[: mask.shape[0]] = mask.numpy()
    return np.packbits(bits, bitorder="little").view(np.int32)


def unpack(packed: np.ndarray, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool masks (B, size) on ``device`` from packed rows (B, W): unpacked on the host for
    the CPU, else copied packed (32 times smaller) and unpacked on the device."""
    device = torch.device(device)
    if device.type == "cpu":
        bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little").view(bool)
        return torch.from_numpy(bits)[:, :size]
    on = torch.from_numpy(packed).to(device, non_blocking=True)                    # (B, W)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (on.unsqueeze(-1) >> shifts) & 1                                        # (B, W, 32)
    return bits.view(packed.shape[0], -1)[:, :size].bool()


def has(row: np.ndarray, token: int) -> bool:
    """Whether the packed row allows ``token``."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def set_bits(packed: np.ndarray, ids: Sequence[int], value) -> None:
    """Allow (``value`` true) or refuse the tokens ``ids`` in packed rows (..., W), in place;
    ``value`` is one bool or one per row."""
    words = packed.view(np.uint32)
    value = np.asarray(value, dtype=bool)
    for t in ids:
        bit = np.uint32(1 << (t & 31))
        column = words[..., t >> 5]
        words[..., t >> 5] = np.where(value, column | bit, column & ~bit)


def trim(packed: np.ndarray, size: int) -> None:
    """Refuse every token from ``size`` on in packed rows (..., W), in place."""
    packed[..., words(size):] = 0
    if size % 32:
        packed.view(np.uint32)[..., size // 32] &= np.uint32((1 << (size % 32)) - 1)
