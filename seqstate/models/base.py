"""The `LanguageModel` protocol the engine runs on, and the counters it keeps."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from seqstate.detokenize import TokenVocabulary
    from seqstate.kv.store import KVStore

__all__ = ["LanguageModel", "Stats"]


@dataclasses.dataclass(frozen=True, slots=True)
class Stats:
    """A snapshot of a model's work counters and KV-store accounting.

    Subtract two snapshots to see what one call did::

        before = model.stats
        text("Hello", max_tokens=4)
        (model.stats - before).prefill_tokens
    """

    prefill_tokens: int = 0          # tokens whose KV was computed in a prefill forward
    decode_tokens: int = 0           # tokens fed one-per-row in decode steps
    cached_tokens_reused: int = 0    # tokens whose KV came from the store instead of a forward
    forward_calls: int = 0
    kv_bytes_held: int = 0           # bytes of segments pinned by live states
    kv_bytes_cached: int = 0         # bytes of every segment in the store (held + evictable)
    evictions: int = 0               # segments dropped by the LRU under the byte budget
    segments: int = 0

    def __sub__(self, other: Stats) -> Stats:
        return Stats(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                        for f in dataclasses.fields(self)})


@runtime_checkable
class LanguageModel(Protocol):
    """What the engine needs from a model.

    seqstate's own adapter is :class:`seqstate.models.hf.Model`; anything with these members can
    be driven by the engine.
    """

    hf_model: Any
    hf_tokenizer: Any
    store: KVStore
    vocab: TokenVocabulary

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def context_length(self) -> int: ...

    @property
    def stats(self) -> Stats: ...

    def encode(self, text: str) -> list[int]: ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor, cache: Any, *, logits: bool | str = True) -> torch.Tensor | None:
        """Run the network over ``input_ids`` (B, T) appending to ``cache``.

        Returns the last position's logits (B, V) as float32, or None when ``logits`` is False
        (prefill: the LM head is skipped).
        """
        ...
