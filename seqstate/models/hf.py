"""seqstate's adapter around a Hugging Face causal LM and its tokenizer."""

from __future__ import annotations

import threading
from functools import cached_property
from typing import Any

import torch

from seqstate.detokenize import TokenVocabulary
from seqstate.kv.store import DEFAULT_BUDGET_BYTES, KVStore
from seqstate.models.base import Stats

__all__ = ["Model"]


class Model:
    """A causal LM with its tokenizer, KV store, compiled-constraint cache and counters.

    Build one with :func:`seqstate.models.default`, :func:`~seqstate.models.transformers`,
    :func:`~seqstate.models.from_hf` or :func:`~seqstate.models.from_outlines`.

    Parameters
    ----------
    hf_model, hf_tokenizer:
        A ``transformers`` causal LM (in eval mode) and its fast tokenizer.
    kv_budget_bytes:
        Byte budget of the KV store's cache of unreferenced segments.
    name:
        A label shown in reprs and error messages.
    """

    def __init__(self, hf_model: Any, hf_tokenizer: Any, *,
                 kv_budget_bytes: int = DEFAULT_BUDGET_BYTES, name: str | None = None) -> None:
        self.hf_model = hf_model.eval()
        self.hf_tokenizer = hf_tokenizer
        self.name = name or getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__
        self.store = KVStore(kv_budget_bytes)
        self.lock = threading.RLock()                 # one engine call at a time per model
        self.constraint_cache: dict[Any, Any] = {}   # compiled constraints, keyed by spec
        self._counters = dict(prefill_tokens=0, decode_tokens=0, cached_tokens_reused=0,
                              forward_calls=0)
        cfg = hf_model.config.get_text_config(decoder=True)
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._decoder = hf_model.get_decoder()

    def __repr__(self) -> str:
        return f"<seqstate Model {self.name!r} layers={self.num_layers} ctx={self.context_length}>"

    # -- tokenizer ----------------------------------------------------------------------------
    @cached_property
    def vocab(self) -> TokenVocabulary:
        return TokenVocabulary(self.hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.vocab.encode(text)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.hf_model, "generation_config", None), self.hf_model.config,
                       self.hf_tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return frozenset(ids)

    @property
    def pad_token_id(self) -> int:
        pad = self.hf_tokenizer.pad_token_id
        return pad if pad is not None else min(self.eos_token_ids, default=0)

    @cached_property
    def start_token_ids(self) -> list[int]:
        """What an empty prompt is replaced by: the BOS token (or EOS where there is none)."""
        bos = self.hf_tokenizer.bos_token_id
        if bos is None:
            bos = getattr(self.hf_model.config, "bos_token_id", None)
        return [bos if bos is not None else min(self.eos_token_ids)]

    @property
    def context_length(self) -> int:
        cfg = self.hf_model.config.get_text_config(decoder=True)
        return int(getattr(cfg, "max_position_embeddings", None) or 2048)

    @property
    def device(self) -> torch.device:
        return self.hf_model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf_model.dtype

    # -- counters -----------------------------------------------------------------------------
    @property
    def stats(self) -> Stats:
        """A snapshot of the counters and the store's byte accounting."""
        s = self.store
        return Stats(**self._counters, kv_bytes_held=s.bytes_held, kv_bytes_cached=s.bytes_cached,
                     evictions=s.evictions, segments=s.num_segments)

    def count(self, **deltas: int) -> None:
        for k, v in deltas.items():
            self._counters[k] += v

    # -- network ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor, cache: Any, *, logits: bool | str = True) -> torch.Tensor | None:
        """Run ``input_ids`` (B, T) over ``cache``; last-position logits (B, V) in float32 or None.

        ``attention_mask`` (B, past + T) may be None when no row is padded.  ``logits=False``
        skips the LM head (prefill); ``logits="all"`` returns every position's (B, T, V).
        """
        self._counters["forward_calls"] += 1
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, past_key_values=cache, use_cache=True)
        if not logits:
            self._decoder(**kwargs)                                # prefill: skip the LM head
            return None
        if logits == "all":
            return self.hf_model(**kwargs, logits_to_keep=0).logits.float()   # (B, T, V)
        out = self.hf_model(**kwargs, logits_to_keep=1)
        return out.logits[:, -1, :].float()                       # (B, V)

    @torch.inference_mode()
    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits (T, V) of a fresh forward over ``ids`` with no cache: the exactness reference."""
        out = self.hf_model(input_ids=torch.tensor([ids], device=self.device), use_cache=False)
        return out.logits[0].float()
