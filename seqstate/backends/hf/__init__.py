"""The Hugging Face engine: the reference backend, exact against a fresh fp32 forward.

KV lives in the model's radix store of torch segments (`seqstate.kv.store`); a call's
rows are loaded into an in-place decode buffer (`HFBatch`) and finished rows write
their new KV back as segments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqstate.backends.base import Capabilities
from seqstate.backends.hf.batch import HFBatch
from seqstate.backends.hf.prefill import ensure_kv, run_tails
from seqstate.kv.store import KVHandle

__all__ = ["HFBackend", "HFBatch"]


class HFBackend:
    """The backend of a `seqstate.models.Model` (a transformers causal LM)."""

    capabilities = Capabilities(name="hf", exact=True)

    def __init__(self, model) -> None:
        self.model = model
        self.counters = dict(prefill_tokens=0, decode_tokens=0, cached_tokens_reused=0,
                             forward_calls=0, draft_tokens_accepted=0, draft_tokens_rejected=0)

    def count(self, **deltas: int) -> None:
        for k, v in deltas.items():
            self.counters[k] += v

    def kv_stats(self) -> dict[str, int]:
        s = self.model.store
        return dict(kv_bytes_held=s.bytes_held, kv_bytes_cached=s.bytes_cached,
                    evictions=s.evictions, segments=s.num_segments)

    def batch(self) -> HFBatch:
        return HFBatch(self)

    def score(self, prefixes: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
              ) -> list[list[tuple[list[float], KVHandle]]]:
        """All (prefix, continuation) pairs in one batched forward over the continuations."""
        bases = ensure_kv(self.model, prefixes)
        rows = [(tuple(p) + tuple(c[:-1]), h) for p, h in zip(prefixes, bases) for c in continuations]
        handles, logits = run_tails(self.model, rows, logits=True)                  # (B, T, V)
        logprobs = logits.log_softmax(dim=-1)
        width = logprobs.shape[1]
        out, k = [], 0
        for _ in prefixes:
            per = []
            for c in continuations:
                cols = range(width - len(c), width)             # the tail is prefix[-1] + c[:-1]
                per.append(([logprobs[k, col, tok].item() for col, tok in zip(cols, c)], handles[k]))
                k += 1
            out.append(per)
        return out

    def fresh_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        return self.model.full_logits(list(tokens))
