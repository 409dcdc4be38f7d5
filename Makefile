# The README's two commands: `make run` (plan the default model on a sample cluster) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so pip takes the CPU wheel on disk and never pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/hap plan --model zoo:gpt --cluster sample_clusters/hap_paper_testbed_machines.json --out plan.json

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python bench/synthesis.py

clean:
	rm -rf $(VENV) plan.json .pytest_cache
