# The README's commands: `make run` (the workbench, with the default model planned), `make notebook` (the tour in
# JupyterLab) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run notebook test install bench clean slurm-packages

# Bytecode caches on, whatever the environment says: every rank and `hap` subprocess of the suite imports the
# engine, and without .pyc files each compiles it from source again, as each pytest worker rewrites the asserts
# of all 250 test modules again (25 s of CPU per worker). The caches go to the git-ignored __pycache__ folders.
unexport PYTHONDONTWRITEBYTECODE

# torch first, pinned, with pip: pip takes the CPU wheel on this kind of machine's disk and never pulls a CUDA
# build. The rest with uv, which installs the ~170 packages in seconds where pip takes minutes; torch==2.13.0 is
# repeated so that no package can make uv replace it. No bytecode is compiled at install (pip's compiling of torch
# alone takes a minute): a module's .pyc is written the first time it is imported, for the few hundred modules
# the product uses rather than the whole of transformers.
$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv==0.13.9
	VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/uv pip install -q -e ".[test,app,notebook]" torch==2.13.0
	touch $@

install: $(BIN)/.installed

# the workbench on http://127.0.0.1:8501, with a default model and cluster already planned
run: install
	$(BIN)/hap ui --port 8501

# the tour notebook (examples/tour.ipynb) in JupyterLab on http://127.0.0.1:8888, its kernel this environment
notebook: install
	$(BIN)/jupyter lab --ip 127.0.0.1 examples/tour.ipynb

# The whole suite: everything on $(WORKERS) workers (pytest-xdist; ranks start from a warm forkserver,
# tests/runner/dist_harness.py) and, beside them in a process of its own, the bundles submitted to a real Slurm
# (one slurmctld per machine, tests/runner/slurm_harness.py; its output follows the parallel pass's); then,
# alone, the two tests that measure wall-clock time. Each pass lists its slowest tests.
WORKERS ?= 2
test: install slurm-packages
	@mkdir -p tests/artifacts; $(BIN)/python -m pytest -m serial --durations=8 tests/runner/test_slurm.py > tests/artifacts/slurm-tests.log 2>&1 & slurm=$$!; \
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal -m "not serial" --durations=25; parallel=$$?; \
	wait $$slurm; slurm_status=$$?; echo "--- the Slurm tests (run beside the parallel pass):"; cat tests/artifacts/slurm-tests.log; \
	test $$parallel = 0 -a $$slurm_status = 0
	$(BIN)/python -m pytest -m serial --durations=2 tests/runner/test_runner_timing.py

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
