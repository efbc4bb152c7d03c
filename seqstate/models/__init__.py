"""Models: the engine-independent base, the transformers adapter and the loaders."""

from seqstate.models import testing
from seqstate.models.base import BaseModel, Stats
from seqstate.models.hf import Model
from seqstate.models.loading import (cache_dir, default, default_gguf, from_hf, from_outlines,
                                      gemma3_gguf, gguf_tokenizer, llamacpp, transformers,
                                      vllm)

__all__ = ["BaseModel", "Model", "Stats", "default", "transformers", "from_hf",
           "from_outlines", "cache_dir", "testing", "llamacpp", "default_gguf",
           "gemma3_gguf", "gguf_tokenizer", "vllm"]
