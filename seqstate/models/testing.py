"""Small random-weight models for fast tests, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import torch

from seqstate.backends.hf.model import HFModel
from seqstate.backends.hf.store import DEFAULT_BUDGET_BYTES
from seqstate.models.loading import default_tokenizer

__all__ = ["tiny"]


def tiny(*, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, seed: int = 0,
         context_length: int = 2048, kv_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> HFModel:
    """A random-weight Llama with SmolLM2's tokenizer; the same ``seed`` gives the same weights.

    The global torch RNG is left as it was.

    Examples
    --------
    >>> import seqstate as ss
    >>> a, b = ss.models.testing.tiny(), ss.models.testing.tiny()
    >>> pairs = zip(a.hf_model.parameters(), b.hf_model.parameters())
    >>> all((p == q).all() for p, q in pairs)
    True
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = default_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context_length, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True, initializer_range=0.5, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = LlamaForCausalLM(config)
    return HFModel(hf.eval(), tok, kv_budget_bytes=kv_budget_bytes, name=f"tiny(seed={seed})")
