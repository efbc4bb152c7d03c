"""Tensors a step keeps from one step to the next, instead of allocating them anew."""

from __future__ import annotations

import torch

__all__ = ["StepBuffers"]


class StepBuffers:
    """Large tensors steps write (masked logits, gathered rows), kept by name.

    A new (rows, vocabulary) tensor at every step would have its memory mapped again
    whenever the C allocator has given it back to the system; one kept tensor per use is
    mapped once.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def tensor(self, name: str, like: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """A tensor of ``like``'s dtype, device and shape (with ``rows`` rows if given), kept
        under ``name`` and grown when asked for more rows than before.  Valid until the next
        request for ``name``."""
        n = like.shape[0] if rows is None else rows
        b = self._tensors.get(name)
        if (b is None or b.shape[0] < n or b.shape[1:] != like.shape[1:]
                or b.dtype != like.dtype or b.device != like.device
                or b.is_inference() and not torch.is_inference_mode_enabled()):
            b = self._tensors[name] = torch.empty((max(n, 1), *like.shape[1:]),
                                                  dtype=like.dtype, device=like.device)
        return b[:n]

    def close(self) -> None:
        """Drop the tensors."""
        self._tensors.clear()
