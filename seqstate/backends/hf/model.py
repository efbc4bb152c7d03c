"""A Hugging Face causal LM and its tokenizer on the ``hf`` engine."""

from __future__ import annotations

from typing import Any

import torch

from seqstate.backends.hf.backend import HFBackend
from seqstate.backends.hf.store import DEFAULT_BUDGET_BYTES
from seqstate.models.base import BaseModel

__all__ = ["HFModel"]


class HFModel(BaseModel):
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
        self.backend = HFBackend(self.hf_model, pad_token_id=self.pad_token_id,
                                 kv_budget_bytes=kv_budget_bytes)

    def _eos_sources(self) -> list[Any]:
        return [getattr(self.hf_model, "generation_config", None), self.hf_model.config,
                self.hf_tokenizer]

    @property
    def dtype(self) -> torch.dtype:
        return self.backend.dtype

    @property
    def num_layers(self) -> int:
        return self.backend.num_layers

    @property
    def kv_heads(self) -> int:
        return self.backend.kv_heads

    @property
    def head_dim(self) -> int:
        return self.backend.head_dim
