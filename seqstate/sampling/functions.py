"""Pure sampling functions on a batch of logits: samplers' argmax and race, filters and
penalties.  The step's own reads of its logits are `seqstate.engine.logits`."""

from __future__ import annotations

import numpy as np
import torch

from seqstate.errors import LogitsError

__all__ = ["host_values", "greedy_tokens", "race_sample", "check_logprobs", "filter_top_k",
           "filter_top_p", "filter_min_p", "repetition_penalty", "presence_frequency_penalty"]


_HOST_DTYPES = (torch.float32, torch.float16, torch.float64)     # the ones NumPy has


def host_values(values: torch.Tensor) -> np.ndarray | None:
    """``values`` as a NumPy array (no copy) where they are on the CPU in a dtype NumPy has."""
    if not values.is_cpu or values.dtype not in _HOST_DTYPES:
        return None
    return (values.detach() if values.requires_grad else values).numpy()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax per row (first index on ties, like Hugging Face), (B,) on the logits' device.

    CPU logits go to NumPy's argmax, vectorized where torch's CPU argmax (and ``max`` along a
    dimension) is a scalar loop.  Its tie and NaN rules are torch's (first index; NaN highest).
    """
    host = host_values(logits)
    return logits.argmax(dim=-1) if host is None else torch.from_numpy(host.argmax(axis=-1))


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


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token."""
    probs = logits.softmax(dim=-1)                                  # (B, V)
    floor = min_p * probs.amax(dim=-1, keepdim=True)                # (B, 1)
    return logits.masked_fill(probs < floor, float("-inf"))


def repetition_penalty(logits: torch.Tensor, history: list[torch.Tensor],
                       penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (as Hugging Face applies it): the logit of every token in
    row ``b``'s ``history[b]`` is divided by ``penalty`` when positive, multiplied when not."""
    out = logits.clone()
    for b, seen in enumerate(history):
        if seen.numel():
            picked = out[b, seen]
            out[b, seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return out


def presence_frequency_penalty(logits: torch.Tensor, history: list[torch.Tensor],
                               presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's penalties: subtract ``presence`` from the logit of every token that occurs
    in row ``b``'s ``history[b]``, and ``frequency`` times the number of its occurrences."""
    out = logits.clone()
    for b, seen in enumerate(history):
        if seen.numel():
            counts = torch.bincount(seen, minlength=logits.shape[-1]).to(logits.dtype)  # (V,)
            out[b] -= presence * (counts > 0).to(logits.dtype) + frequency * counts
    return out


def race_sample(logits: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor:
    """Sample one token per row exactly from ``softmax(logits)``: the exponential race.

    Token ``i`` wins with ``p_i / E_i`` largest, ``E_i ~ Exp(1)`` drawn from ``rng``; that is
    exact sampling (the Gumbel-max trick).  Unlike inverting a cumulative sum over the whole
    vocabulary, whose boundaries move with the summed rounding of every earlier token, the
    winner only changes if two tokens' races end within the logits' noise, so a seeded call
    samples the same tokens whatever else shares its batch (batching changes logits in the
    last bits).

    The race is drawn on ``rng``'s device: the engine gives each call a generator on its
    logits' device (`seqstate.call.Call.generator`), so nothing moves.  A generator of
    another device (a CPU one passed as ``rng=`` to a model on a GPU) still works: its draws
    are moved to the logits, the same draws as on the CPU, at the cost of a (B, V) copy.
    """
    probs = logits.softmax(dim=-1)                                  # (B, V)
    where = probs.device if rng is None else rng.device
    race = torch.empty(probs.shape, dtype=probs.dtype, device=where).exponential_(
        generator=rng).to(probs.device)                             # (B, V)
    return (probs / race).argmax(dim=-1)                            # (B,)


def check_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """``logprobs`` (a log-softmax over the last axis), refused with `LogitsError` where a
    value is NaN: a row whose logits hold a NaN or a +inf, or no finite value, which is how
    a float16/bfloat16 forward that overflowed shows (a token the model rules out is -inf,
    never NaN)."""
    if torch.isnan(logprobs).any():
        raise LogitsError("log-probs came out NaN: the model's logits hold NaN or infinite "
                          "values, most likely because its forward overflowed in float16 or "
                          "bfloat16; load it with dtype=torch.float32 (or bfloat16 rather "
                          "than float16), else check its weights")
    return logprobs
