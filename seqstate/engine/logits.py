"""The step's reads of a batch of logits (B, V): their shape and finiteness checked, each
row's argmax and the values at chosen tokens, on the CPU straight from NumPy."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from seqstate.errors import LogitsError
from seqstate.sampling.functions import host_values

__all__ = ["check_rows", "finite_rows", "greedy_list", "picked_values"]


def check_rows(logits: torch.Tensor, rows: int) -> None:
    """Refuse ``logits`` that are not a (rows, V) tensor, a row per stepped row (`LogitsError`)."""
    if isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.shape[0] == rows:
        return
    got = (f"shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
           else type(logits).__name__)
    raise LogitsError(f"expected logits for {rows} live rows, a tensor of shape ({rows}, vocab) "
                      f"in `live` order, got {got}; feed one row of logits per row of "
                      "stepper.live (or of `rows`)")


def finite_rows(logits: torch.Tensor, best: list[int]) -> bool:
    """Whether no row holds a NaN or +inf (either shows at the row's argmax ``best``, as does a
    row of -inf); a row with no finite logit at all is refused (`LogitsError`)."""
    if all(map(math.isfinite, picked_values(logits, best))):
        return True
    if not torch.isfinite(logits).any(dim=-1).all():
        raise LogitsError(f"a row's logits are all NaN/inf (dtype {logits.dtype}): most likely "
                          "the model's forward overflowed in float16/bfloat16; load it with "
                          "dtype=torch.float32 (or bfloat16 rather than float16), else check "
                          "its weights or the custom step that made these logits")
    return False


def greedy_list(logits: torch.Tensor) -> list[int]:
    """`seqstate.sampling.functions.greedy_tokens` as a Python list (on the CPU straight from NumPy's argmax)."""
    host = host_values(logits)
    return (logits.argmax(dim=-1) if host is None else host.argmax(axis=-1)).tolist()


def picked_values(values: torch.Tensor, index: Sequence[int]) -> list[float]:
    """``values[b, index[b]]`` for every row ``b`` of (B, V) ``values``, as floats: one NumPy
    index on the CPU, else a gather."""
    host = host_values(values)
    if host is not None:
        return host[_rows(len(index)), index].tolist()
    where = torch.tensor(index, dtype=torch.long, device=values.device)[:, None]      # (B, 1)
    return values.gather(1, where).squeeze(1).tolist()


@functools.lru_cache(maxsize=64)
def _rows(n: int) -> np.ndarray:
    """``0 .. n-1`` for NumPy's row indexing (made once per batch size)."""
    rows = np.arange(n)
    rows.flags.writeable = False
    return rows
