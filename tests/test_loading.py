"""What `seqstate.models.loading` says when a model cannot be had: each message names the cause
and what to do, with the error type a caller catches (nothing here downloads)."""

from __future__ import annotations

import copy
import http.server
import json
import threading
from pathlib import Path

import pytest

import seqstate as ss
from seqstate.models import loading

from conftest import request_llamacpp


# -- transformers ---------------------------------------------------------------------------------
def test_a_hub_id_not_in_the_local_cache_says_how_to_put_it_there():
    with pytest.raises(ss.ModelNotAvailable) as err:
        ss.models.transformers("some-org/not-on-this-machine")
    message = str(err.value)
    assert "not (or only in part) in the local cache" in message
    assert "hf download some-org/not-on-this-machine" in message
    assert "HF_HUB_CACHE" in message


def test_a_missing_or_empty_directory_is_named_as_one(tmp_path):
    with pytest.raises(ss.ModelNotAvailable, match="no directory at"):
        ss.models.transformers(tmp_path / "missing")
    # a folder without config.json (transformers raises ValueError for it): typed all the same
    with pytest.raises(ss.ModelNotAvailable, match="config.json"):
        ss.models.transformers(tmp_path)


# -- llama.cpp ------------------------------------------------------------------------------------
@pytest.fixture
def gguf():
    request_llamacpp()
    return ss.models.default_gguf()


def test_a_truncated_gguf_is_named_as_one(gguf, tmp_path):
    for size in (8_000_000, 1_000):          # the tensors cut off; the header itself cut off
        cut = tmp_path / f"cut-{size}.gguf"
        with open(gguf, "rb") as source:
            cut.write_bytes(source.read(size))
        with pytest.raises(ss.ModelNotAvailable) as err:
            ss.models.llamacpp(cut, tokenizer=loading.default_tokenizer(), n_threads=1)
        message = str(err.value)
        assert "truncated" in message and "fetch it again" in message
        assert "architecture" not in message and "expected a GGUF" not in message


def test_a_gguf_of_an_unknown_architecture_names_it(gguf, tmp_path):
    import gguf as gguf_format
    import numpy as np

    path = tmp_path / "nonesuch.gguf"
    writer = gguf_format.GGUFWriter(path, "nonesuch")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ss.ModelNotAvailable) as err:
        ss.models.llamacpp(path, tokenizer=loading.default_tokenizer(), n_threads=1)
    message = str(err.value)
    assert "unknown model architecture: 'nonesuch'" in message
    assert "does not know" in message and "a newer llama-cpp-python" in message


def test_a_context_llama_cpp_cannot_create_suggests_a_smaller_n_ctx(gguf, monkeypatch):
    # 20 million KV cells: some 640 GiB, which a kernel that refuses allocations beyond its
    # memory (overcommit modes 0 and 2) refuses at once.  Mode 1 grants it and llama.cpp would
    # then clear it page by page until the process is killed: there, fail the creation instead.
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        from seqstate.backends.llamacpp import native

        monkeypatch.setattr(native.ll, "llama_init_from_model", lambda model, params: None)
    with pytest.raises(ss.ModelNotAvailable) as err:
        ss.models.llamacpp(gguf, tokenizer=loading.default_tokenizer(), n_ctx=20_000_000,
                           n_threads=1)
    message = str(err.value)
    assert "could not create a context" in message and "GiB" in message
    assert "pass a smaller n_ctx" in message and "n_seq_max" in message


def test_a_tokenizer_of_another_size_is_a_model_mismatch(gguf):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    larger = copy.deepcopy(loading.default_tokenizer())
    larger.add_tokens(["<not-in-the-gguf>"])
    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    smaller = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>",
                                      eos_token="<unk>")
    for tokenizer, size in ((larger, 49153), (smaller, 3)):
        with pytest.raises(ss.ModelMismatch, match=f"the tokenizer has {size} tokens but "
                                                    f"{gguf.name} has 49152"):
            ss.models.llamacpp(gguf, tokenizer=tokenizer, n_ctx=256, n_threads=1)


def test_only_unused_padding_may_lie_beyond_a_tokenizer(gguf):
    from seqstate.backends.llamacpp import native

    assert native.padding_only(gguf, 49152)             # nothing beyond: the file's own size
    assert not native.padding_only(gguf, 49151)         # a real token beyond


# -- vLLM -----------------------------------------------------------------------------------------
def _serving(models: list[dict]) -> http.server.ThreadingHTTPServer:
    """A server whose /v1/models lists ``models`` (all `ss.models.vllm` asks before a call)."""

    class Models(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"object": "list", "data": models}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_a_server_with_no_model_says_so():
    httpd = _serving([])
    try:
        with pytest.raises(ss.ModelNotAvailable) as err:
            ss.models.vllm(f"http://127.0.0.1:{httpd.server_address[1]}")
        assert "serves no model" in str(err.value) and "[]" not in str(err.value)
    finally:
        httpd.shutdown()


def test_a_server_with_several_models_or_not_the_one_asked_for():
    httpd = _serving([{"id": "a", "root": ""}, {"id": "b", "root": ""}])
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(ss.ArgumentError, match="serves 2 models \\('a', 'b'\\); pass model="):
            ss.models.vllm(url)
        with pytest.raises(ss.ArgumentError, match="serves no model 'c'; it serves 'a', 'b'"):
            ss.models.vllm(url, model="c")
    finally:
        httpd.shutdown()


def test_a_served_model_takes_the_tokenizer_keyword_and_never_reads_this_folder(tiny, tmp_path,
                                                                                monkeypatch):
    # a tokenizer in the working directory must not be taken for the served model's
    tiny.hf_tokenizer.save_pretrained(tmp_path)
    monkeypatch.chdir(tmp_path)
    httpd = _serving([{"id": "remote", "root": None, "max_model_len": 512}])
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(ss.ModelNotAvailable, match="pass tokenizer="):
            ss.models.vllm(url)
        model = ss.models.vllm(url, tokenizer=tiny.hf_tokenizer)
        assert model.hf_tokenizer is tiny.hf_tokenizer and model.folder is None
        assert model.engine == "vllm" and model.context_length == 512
        model.close()
    finally:
        httpd.shutdown()
