# The README's two commands: `make run` (the workbench, with the default model planned) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so pip takes the CPU wheel on disk and never pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,app]"
	touch $@

install: $(BIN)/.installed

# the workbench on http://127.0.0.1:8501, with a default model and cluster already planned
run: install
	$(BIN)/hap ui --port 8501

# The whole suite in two passes: everything on $(WORKERS) workers (pytest-xdist; ranks start from a warm
# forkserver, tests/runner/dist_harness.py), then the few tests that measure wall-clock time, alone.
# Each pass lists its slowest tests.
WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal -m "not serial" --durations=25
	$(BIN)/python -m pytest -m serial --durations=5 tests/runner/test_runner_timing.py

bench: install
	$(BIN)/python bench/synthesis.py

clean:
	rm -rf $(VENV) plan.json .pytest_cache tests/artifacts
