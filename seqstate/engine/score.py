"""Option scoring: the log-probs of whole continuations, in one batched prefill."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqstate.engine.prefill import ensure_kv, run_tails
from seqstate.kv.store import KVHandle
from seqstate.models.hf import Model

__all__ = ["score_continuations"]


def score_continuations(model: Model, prefixes: Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[int]]
                        ) -> list[list[tuple[list[float], KVHandle]]]:
    """Per-token log-probs of every continuation after every prefix, with KV handles.

    The prefixes' KV comes from the store (computed once); all (prefix, continuation) pairs run
    in one batched forward over the continuations only.  Result ``[p][c]`` is
    ``(log-probs of continuation c's tokens after prefix p, handle on prefix + c[:-1])``.
    """
    with model.lock, torch.inference_mode():
        bases = ensure_kv(model, prefixes)
        rows = [(tuple(p) + tuple(c[:-1]), h) for p, h in zip(prefixes, bases) for c in continuations]
        handles, logits = run_tails(model, rows, logits=True)                    # (B, T, V)
        logprobs = logits.log_softmax(dim=-1)
        width = logprobs.shape[1]
        out: list[list[tuple[list[float], KVHandle]]] = []
        k = 0
        for _ in prefixes:
            per = []
            for c in continuations:
                cols = range(width - len(c), width)                 # tail = prefix[-1] + c[:-1]
                lps = [logprobs[k, col, tok].item() for col, tok in zip(cols, c)]
                per.append((lps, handles[k]))
                k += 1
            out.append(per)
        return out
