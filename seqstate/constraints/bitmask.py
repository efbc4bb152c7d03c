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

__all__ = ["CPU", "words", "pack", "unpack", "unpack_tensor", "has", "set_bits", "trim"]


def words(size: int) -> int:
    """Words in a packed row of ``size`` tokens."""
    return (size + 31) // 32


def pack(mask: torch.Tensor, n: int) -> np.ndarray:
    """The bool mask ``mask`` (V,) as a packed row of ``n`` words (tokens past V refused)."""
    bits = np.zeros(n * 32, dtype=bool)
    bits[: mask.shape[0]] = mask.numpy()
    return np.packbits(bits, bitorder="little").view(np.int32)


CPU = torch.device("cpu")


def unpack(packed: np.ndarray, size: int, device: torch.device = CPU) -> torch.Tensor:
    """Bool masks (B, size) on ``device`` from packed rows (B, W): unpacked on the host for
    the CPU, else copied packed (32 times smaller) and unpacked on the device
    (`unpack_tensor`)."""
    if device.type == "cpu":
        bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little").view(bool)
        mask = torch.from_numpy(bits)
        return mask if bits.shape[-1] == size else mask[:, :size]
    return unpack_tensor(torch.from_numpy(packed).to(device, non_blocking=True), size)


def unpack_tensor(packed: torch.Tensor, size: int) -> torch.Tensor:
    """Bool masks (B, size) from packed rows (B, W), an int32 tensor on any device, unpacked
    there.

    >>> packed = np.array([[5, -1], [0, 1 << 30]], dtype=np.int32)
    >>> torch.equal(unpack_tensor(torch.from_numpy(packed), 63), unpack(packed, 63))
    True
    """
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1                                    # (B, W, 32)
    return bits.view(packed.shape[0], -1)[:, :size].bool()


def has(row: np.ndarray, token: int) -> bool:
    """Whether the packed row allows ``token``."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def set_bits(packed: np.ndarray, ids: Sequence[int], value: bool) -> None:
    """Allow (``value`` true) or refuse the tokens ``ids`` in packed rows (..., W), in
    place."""
    words = packed.view(np.uint32)
    for t in ids:
        bit = np.uint32(1 << (t & 31))
        if value:
            words[..., t >> 5] |= bit
        else:
            words[..., t >> 5] &= ~bit


def trim(packed: np.ndarray, size: int) -> None:
    """Refuse the tokens from ``size`` on that packed rows (..., words(size)) hold, in
    place."""
    if size % 32:
        packed.view(np.uint32)[..., size // 32] &= np.uint32((1 << (size % 32)) - 1)
