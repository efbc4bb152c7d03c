"""seqstate's adapter around a Hugging Face causal LM and its tokenizer (the ``hf`` engine)."""

from __future__ import annotations

from typing import Any

import torch

from seqstate.backends.hf import HFBackend
from seqstate.kv.store import DEFAULT_BUDGET_BYTES, KVStore
from seqstate.models.base import BaseModel

__all__ = ["Model"]


class Model(BaseModel):
    """A causal LM with its tokenizer, KV store, compiled-constraint cache and counters.

    Build one with `seqstate.models.default()`, `transformers()`,
    `from_hf()` or `from_outlines()`.

    Parameters
    ----------
    hf_model : transformers.PreTrainedModel
        A ``transformers`` causal LM (put in eval mode).
    hf_tokenizer : transformers.PreTrainedTokenizerFast
        Its fast tokenizer.
    kv_budget_bytes : int
        Byte budget of the KV store's cache of unreferenced segments.
    name : str, optional
        A label shown in reprs and error messages.
    """

    def __init__(self, hf_model: Any, hf_tokenizer: Any, *,
                 kv_budget_bytes: int = DEFAULT_BUDGET_BYTES, name: str | None = None) -> None:
        super().__init__(hf_tokenizer, name or getattr(hf_model.config, "_name_or_path", "")
                         or type(hf_model).__name__)
        self.hf_model = hf_model.eval()
        self.store = KVStore(kv_budget_bytes)
        self.backend = HFBackend(self)
        cfg = hf_model.config.get_text_config(decoder=True)
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._decoder = hf_model.get_decoder()

    def _eos_sources(self) -> list[Any]:
        return [getattr(self.hf_model, "generation_config", None), self.hf_model.config,
                self.hf_tokenizer]

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

    # -- network ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor, cache: Any, *, logits: bool | str = True) -> torch.Tensor | None:
        """Run ``input_ids`` (B, T) over ``cache``; last-position logits (B, V) in float32 or None.

        ``attention_mask`` (B, past + T) may be None when no row is padded.  ``logits=False``
        skips the LM head (prefill); ``logits="all"`` returns every position's (B, T, V).
        """
        self.count(forward_calls=1)
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
