"""The HF engine is correct on any device by construction: every tensor it creates is put
on the device of the logits it meets (or is host-side on purpose, with the reason), a device
the machine lacks is refused before any weight is read, and logits that overflowed in
float16/bfloat16 are refused with the cause named.

What needs a real GPU (the same results there) is `make gpu-check` (tests/gpu/).
"""

from __future__ import annotations

import ast
import pathlib
import tempfile

import pytest
import torch

import seqstate as ss
from conftest import assert_close
from fake_cuda import FakeCuda, OnDevice, to_fake_cuda
from seqstate.backends.hf.loader import device_of
from seqstate.call import Call
from seqstate.sampling.functions import race_sample

PACKAGE = pathlib.Path(ss.__file__).parent
ROOT = PACKAGE.parent
NO_CUDA = not torch.cuda.is_available()

# torch functions that make a tensor (or a generator) from nothing: without ``device=`` they
# make it on the CPU.  ``*_like`` and ``tensor.new_*`` inherit their source's device.
FACTORIES = frozenset({
    "tensor", "as_tensor", "asarray", "from_numpy", "frombuffer", "zeros", "ones", "full",
    "empty", "empty_strided", "arange", "range", "linspace", "logspace", "eye", "rand", "randn",
    "randint", "randperm", "normal", "scalar_tensor", "tril_indices", "triu_indices",
    "sparse_coo_tensor", "Generator",
})

# What the walk covers: the engine, sampling, the engine-neutral backend modules, the HF
# engine and the scores.  Not walked: backends/llamacpp/ and backends/vllm/, whose logits come
# back as host memory by nature (llama.cpp hands Python a float array it copied out, a vLLM
# server answers JSON), so their tensors are CPU tensors and stay so; constraints/, whose
# compiled masks are engine-neutral host caches that the step puts on the logits' device.
WALKED = ["seqstate/engine", "seqstate/sampling", "seqstate/backends/hf", "seqstate/scores.py",
          *sorted(str(p.relative_to(ROOT)) for p in (PACKAGE / "backends").glob("*.py"))]

_HOST_MASK = ("the attention mask's bookkeeping stays on the host (per-row column writes are "
              "cheap there); _feed copies it to the device once per forward")
_HOST_INPUTS = ("input ids, positions and attention masks built from Python lists on the "
                "host, copied to the device once per forward (.to(device)): one copy instead of one per row")

_ON_THE_LOGITS_HOST = ("NumPy's argmax of CPU logits only (`_host_argmax` is None for any other "
                       "device): the CPU is the logits' device")

# (file, function, factory) -> why this tensor is made on the CPU on purpose.  The function is
# a qualname, or "Class.*" for every method of a class.
HOST: dict[tuple[str, str, str], str] = {
    ("seqstate/backends/hf/batch.py", "HFBatch.*", "zeros"): _HOST_MASK,
    ("seqstate/backends/hf/batch.py", "HFBatch._compact", "tensor"):
        "row indexes of the host mask; KVBuffer.keep_rows moves them to the buffer's device",
    ("seqstate/backends/hf/batch.py", "HFBatch._feed", "frombuffer"): _HOST_INPUTS,
    ("seqstate/backends/hf/prefill.py", "run_tails", "frombuffer"): _HOST_INPUTS,
    ("seqstate/backends/hf/packed.py", "_score_group", "full"): _HOST_INPUTS,
    ("seqstate/backends/hf/packed.py", "_score_group", "zeros"): _HOST_INPUTS,
    ("seqstate/backends/hf/packed.py", "_score_group", "arange"): _HOST_INPUTS,
    ("seqstate/backends/hf/packed.py", "_place", "tensor"): _HOST_INPUTS,
    ("seqstate/backends/hf/packed.py", "_place", "arange"): _HOST_INPUTS,
    ("seqstate/backends/hf/packed.py", "_place", "ones"): _HOST_INPUTS,
    ("seqstate/sampling/functions.py", "greedy_tokens", "from_numpy"): _ON_THE_LOGITS_HOST,
    ("seqstate/scores.py", "Scores._table", "full"):
        "a table of Python floats for the user (the log-probs already came back as floats), "
        "on the host like state.weights",
}


def _files() -> list[pathlib.Path]:
    out = []
    for name in WALKED:
        path = ROOT / name
        out.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return out


def _qualname(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    names = []
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
    return ".".join(reversed(names)) or "<module>"


def _on_host(call: ast.Call, parent: ast.AST | None) -> bool:
    """Whether a factory call makes its tensor on the CPU: no ``device=`` (nor a ``.to(...)``
    right after it), or ``device="cpu"`` spelled out."""
    if isinstance(parent, ast.Attribute) and parent.attr == "to":
        return False
    device = next((k.value for k in call.keywords if k.arg == "device"), None)
    if device is None:
        return True
    literal = device.args[0] if (isinstance(device, ast.Call) and device.args
                                 and ast.unparse(device.func) == "torch.device") else device
    return isinstance(literal, ast.Constant) and literal.value == "cpu"


def host_factories() -> set[tuple[str, str, str, int]]:
    """(file, function, factory, line) of every torch factory in the walked modules that makes
    its tensor on the CPU."""
    found = set()
    for path in _files():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "torch":
                named = {a.name for a in node.names} & FACTORIES
                assert not named, f"{rel}:{node.lineno} imports {named} from torch: call torch.X"
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and node.func.attr in FACTORIES):
                continue
            if _on_host(node, parents.get(node)):
                found.add((rel, _qualname(node, parents), node.func.attr, node.lineno))
    return found


def _allowed(rel: str, function: str, factory: str) -> tuple[str, str, str] | None:
    for key in ((rel, function, factory), (rel, function.split(".")[0] + ".*", factory)):
        if key in HOST:
            return key
    return None


def test_every_tensor_the_engine_makes_names_its_device():
    bad = sorted(f"{rel}:{line} {function}: torch.{factory}(...) without device="
                 for rel, function, factory, line in host_factories()
                 if _allowed(rel, function, factory) is None)
    assert not bad, ("tensors made on the CPU where the logits may be on a GPU: pass "
                     "device=<the logits' device> (or list a host-side one in HOST, with the "
                     "reason):\n" + "\n".join(bad))


def test_host_side_list_has_no_stale_entries():
    used = {_allowed(rel, function, factory) for rel, function, factory, _ in host_factories()}
    assert set(HOST) <= used, f"entries in HOST that no longer match a factory: {set(HOST) - used}"


def test_the_walk_finds_what_it_should():
    # the walk itself: a factory without a device, with device="cpu", and with .to() after it
    source = ("import torch\n"
              "def f(x):\n"
              "    a = torch.zeros(3)\n"
              "    b = torch.ones(3, device='cpu')\n"
              "    c = torch.tensor([1]).to(x.device)\n"
              "    d = torch.full((2,), 1, device=x.device)\n")
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr in FACTORIES]
    flagged = {c.func.attr for c in calls if _on_host(c, parents.get(c))}
    assert flagged == {"zeros", "ones"}


# -- devices a machine lacks are refused before any weight is read ------------------------------
@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_a_missing_cuda_device_is_refused_before_loading(device):
    # the folder does not exist: ModelNotAvailable if the loader got that far
    with pytest.raises(ss.ArgumentError, match="sees no CUDA device"):
        ss.models.transformers("/nonexistent/checkpoint", device=device)


@pytest.mark.parametrize("device", ["gpu", "meta", 1.5])
def test_a_malformed_or_empty_device_is_refused(device):
    with pytest.raises(ss.ArgumentError, match="device"):
        device_of(device)


def test_the_model_reports_its_device(tiny):
    assert tiny.device == torch.device("cpu") == tiny.backend.device


# -- seeded sampling: a generator on the model's device --------------------------------------
def test_a_seeded_call_draws_on_the_models_device():
    call = Call(seed=7, sampler=ss.multinomial())
    made = call.generator(torch.device("cpu"))
    assert made.device == torch.device("cpu") and made.initial_seed() == 7
    own = torch.Generator()
    assert Call(rng=own, sampler=ss.multinomial()).generator("cuda") is own


def test_race_sample_draws_on_the_generators_device():
    # logits elsewhere than the generator: drawn on the generator's device, then moved, and
    # the draws are the generator's own (the same as with logits on its device)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    on_cpu = race_sample(logits, torch.Generator().manual_seed(1))
    elsewhere = race_sample(logits.to("meta"), torch.Generator().manual_seed(1))
    assert elsewhere.device.type == "meta" and elsewhere.shape == on_cpu.shape
    # today's CPU draws, bit for bit: the race of torch.empty_like(probs).exponential_()
    probs = logits.softmax(-1)
    race = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(1))
    assert torch.equal(on_cpu, (probs / race).argmax(-1))


# -- float16/bfloat16 overflow: a typed error naming the cause --------------------------------
@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def overflowed(request):
    """The tiny model in a half dtype with one layer's weights beyond what it holds: a float16
    cast makes them inf; in bfloat16 they fit, and their products overflow."""
    src = ss.models.testing.tiny()
    hf = src.hf_model
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight[:] = 1e6 if request.param is torch.float16 else 3e38
    return ss.models.from_hf(hf.to(request.param), src.hf_tokenizer)


def test_decoding_overflowed_logits_names_the_cause(overflowed):
    with pytest.raises(ss.LogitsError, match="overflowed"):
        ss.text(overflowed)("Hello there", max_tokens=3)


def test_scoring_overflowed_logits_names_the_cause(overflowed):
    state = ss.from_tokens(overflowed, [overflowed.encode("Hello there")])
    with pytest.raises(ss.LogitsError, match="overflowed"):
        state.score([" a", " bc de"])
    with pytest.raises(ss.LogitsError, match="overflowed"):
        state.next_logprobs()


def test_scoring_takes_minus_infinity_logits(tiny):
    # a token the model rules out (-inf logit) scores -inf, not an error
    state = ss.from_tokens(tiny, [tiny.encode("Hello there")])
    with torch.no_grad():
        bias = torch.zeros(tiny.backend.vocab_size)
        bias[tiny.encode(" a")[0]] = float("-inf")
        head = tiny.hf_model.get_output_embeddings()
        hook = head.register_forward_hook(lambda m, i, out: out + bias)
    try:
        with tiny.frozen_store():
            sums = state.score([" a", " b"]).sums
    finally:
        hook.remove()
    assert sums[0, 0, 0] == float("-inf") and torch.isfinite(sums[0, 0, 1])


# -- lm-eval's --device ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder():
    src = ss.models.testing.tiny()
    path = tempfile.mkdtemp()
    src.hf_model.save_pretrained(path)
    src.hf_tokenizer.save_pretrained(path)
    return path


def test_lm_eval_loads_on_the_device_asked(folder):
    from seqstate.lm_eval import SeqStateLM

    lm = SeqStateLM(path=folder, device="cpu")
    assert lm.model.device == torch.device("cpu")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
def test_lm_eval_refuses_a_missing_device(folder):
    from seqstate.lm_eval import SeqStateLM

    with pytest.raises(ss.ArgumentError, match="sees no CUDA device"):
        SeqStateLM(path=folder, device="cuda:0")


def test_lm_eval_refuses_a_device_its_model_is_not_on(tiny):
    from seqstate.lm_eval import SeqStateLM

    assert SeqStateLM(model=tiny, device="cpu").model is tiny
    with pytest.raises(ss.ArgumentError, match="model= is on cpu"):
        SeqStateLM(model=tiny, device="cuda:0")


def test_lm_eval_llamacpp_takes_only_the_cpu():
    from seqstate.lm_eval import SeqStateLM

    with pytest.raises(ss.ArgumentError, match="runs on the CPU"):
        SeqStateLM(engine="llama.cpp", path="model.gguf", device="cuda:0")


# -- the engine on a CUDA device made of CPU memory (tests/fake_cuda.py) ------------------------
# Every tensor that meets the logits must be on their device, or torch raises as CUDA would;
# the values are the CPU's, so results equal the CPU engine's exactly.  Not covered: a
# generator made on CUDA (seed= there needs a CUDA build): calls pass a CPU rng= instead.
@pytest.fixture(scope="module")
def fake():
    src = ss.models.testing.tiny()
    model = ss.models.from_hf(to_fake_cuda(src.hf_model), src.hf_tokenizer)
    model.backend.on_worker_start = lambda: FakeCuda().__enter__()   # the worker's thread
    return model


def test_the_fake_device_refuses_what_cuda_refuses():
    logits = OnDevice(torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="same device"):
        logits.masked_fill_(torch.ones(8, dtype=torch.bool), 0.0)
    with pytest.raises(RuntimeError, match="generator"):
        torch.empty_like(logits).exponential_(generator=torch.Generator())
    with pytest.raises(RuntimeError, match="same device"):
        logits.index_select(0, torch.tensor([0]))
    logits[torch.tensor([1])] = float("-inf")               # CPU indexes: allowed on CUDA
    assert logits.device == torch.device("cuda", 0) and logits[1].tolist() == [float("-inf")] * 8


SAMPLER = ss.multinomial(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3,
                         presence_penalty=0.4)
PROGRAMS = {
    "greedy batch": lambda m: ss.text(m)(["Hello there", "Hi"], max_tokens=6),
    "regex": lambda m: ss.regex(m, r"[0-9]{2}-[a-z]{2}")("Code: "),
    "json": lambda m: ss.json(m, {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                  "required": ["ok"]})("Record: "),
    "banned phrase": lambda m: ss.text(m)("Hello there", max_tokens=6,
                                          hooks=[ss.hooks.ban_phrases(["a", "e"])]),
    "sampled, rng": lambda m: ss.text(m)("Hello", num_samples=3, sampler=SAMPLER, max_tokens=6,
                                         rng=torch.Generator().manual_seed(4)),
    "beam search": lambda m: ss.text(m)("Hello", sampler=ss.beam_search(2), max_tokens=4),
}


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_engine_runs_on_a_cuda_device(fake, tiny, program):
    with FakeCuda():
        ours = PROGRAMS[program](fake)
    assert ours.token_ids == PROGRAMS[program](tiny).token_ids
    assert fake.device == torch.device("cuda", 0)


def test_scoring_forks_and_slices_run_on_a_cuda_device(fake, tiny):
    def run(model):
        state = ss.text(model)("The capital of France", max_tokens=6)
        forked = ss.text(model)(state[..., :-2], num_samples=2, sampler=SAMPLER, max_tokens=3,
                                rng=torch.Generator().manual_seed(1))
        scores = forked.score([" is", " was not"])
        return forked, scores, forked.next_logprobs()

    with FakeCuda():
        ours = run(fake)
    theirs = run(tiny)
    assert ours[0].token_ids == theirs[0].token_ids
    # the same weights and tokens; scoring picks its threads by the CPUs free at the time, so
    # two runs agree within the model's noise floor, not to the bit
    def flat(scores):
        return torch.tensor([lp for b in scores.logprobs for s in b for o in s for lp in o])

    assert_close(flat(ours[1]), flat(theirs[1]), tiny, "scores on the CUDA device vs the CPU")
    assert ours[2].device == torch.device("cuda", 0)
    assert_close(ours[2].inner, theirs[2], tiny, "next log-probs on the CUDA device vs the CPU")
