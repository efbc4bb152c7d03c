"""Models: the engine-independent base, the default model and the shared GGUF cache, and each
registered engine's loaders (`seqstate.backends.registry`): ``transformers``, ``from_hf`` and
``from_outlines`` (``hf``), ``llamacpp`` (``llama.cpp``), ``vllm`` (``vllm``).

A loader is imported from its engine's folder when first used, so an engine whose library is
missing costs nothing until it is asked for.
"""

from typing import Any

from seqstate.backends import registry
from seqstate.models import testing
from seqstate.models.base import BaseModel, Stats
from seqstate.models.loading import (cache_dir, default, default_gguf, gemma3_gguf,
                                      gguf_tokenizer)

__all__ = ["BaseModel", "Stats", "default", "cache_dir", "testing", "default_gguf",
           "gemma3_gguf", "gguf_tokenizer"]
__all__ += registry.loader_names()                # the engines' loaders, imported when used


def __getattr__(name: str) -> Any:
    engine = registry.loader_names().get(name)
    if engine is None:
        raise AttributeError(f"module 'seqstate.models' has no attribute {name!r}")
    return getattr(registry.get(engine).loader(), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
