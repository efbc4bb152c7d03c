"""Models: the `LanguageModel` protocol, the transformers adapter and the loaders."""

from seqstate.models import testing
from seqstate.models.base import LanguageModel, Stats
from seqstate.models.hf import Model
from seqstate.models.loading import cache_dir, default, from_hf, from_outlines, transformers

__all__ = ["LanguageModel", "Model", "Stats", "default", "transformers", "from_hf",
           "from_outlines", "cache_dir", "testing"]
