# The README's commands: `make run` (the workbench, with the default model planned), `make notebook` (the tour in
# JupyterLab) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run notebook test install bench clean slurm-packages

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so pip takes the CPU wheel on disk and never pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,app,notebook]"
	touch $@

install: $(BIN)/.installed

# the workbench on http://127.0.0.1:8501, with a default model and cluster already planned
run: install
	$(BIN)/hap ui --port 8501

# the tour notebook (examples/tour.ipynb) in JupyterLab on http://127.0.0.1:8888, its kernel this environment
notebook: install
	$(BIN)/jupyter lab --ip 127.0.0.1 examples/tour.ipynb

# The whole suite in two passes: everything on $(WORKERS) workers (pytest-xdist; ranks start from a warm
# forkserver, tests/runner/dist_harness.py), then, alone, the few tests that measure wall-clock time and the
# bundles submitted to a real Slurm (one slurmctld per machine; tests/runner/slurm_harness.py).
# Each pass lists its slowest tests.
WORKERS ?= 2
test: install slurm-packages
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal -m "not serial" --durations=25
	$(BIN)/python -m pytest -m serial --durations=8 tests/runner/test_runner_timing.py tests/runner/test_slurm.py

# The Slurm tests' system packages, installed only when missing and only where apt-get and root allow;
# elsewhere a line says why and those tests skip, naming the reason.
slurm-packages:
	@if command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; then \
		if command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ]; then exit 0; fi; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then echo "slurm-packages: no apt-get here; the Slurm tests will skip"; \
	elif [ "$$(id -u)" != 0 ]; then echo "slurm-packages: not root, cannot install slurm-wlm munge; the Slurm tests will skip"; \
	else DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
		|| (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null) \
		|| echo "slurm-packages: apt-get could not install slurm-wlm munge; the Slurm tests will skip"; fi

bench: install
	$(BIN)/python bench/synthesis.py

clean:
	rm -rf $(VENV) plan.json .pytest_cache tests/artifacts
