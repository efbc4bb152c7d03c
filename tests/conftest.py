import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

import seqstate as ss  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random Llama with the real tokenizer; shared, so tests must not assume an empty store."""
    return ss.models.testing.tiny()


@pytest.fixture(scope="session")
def real():
    """The real default model (SmolLM2-135M-Instruct)."""
    return ss.models.default()


@pytest.fixture
def fresh_tiny():
    """A tiny model with its own empty KV store, for tests that count bytes or prefill tokens."""
    return ss.models.testing.tiny()
