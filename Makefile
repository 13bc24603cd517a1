# Set-up and the two entry points. Everything installs itself into .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Where a local torch wheel lives on our machines; harmless where it does not exist.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q $(FIND_LINKS) -c constraints.txt
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-slow test-gpu lint bench bench-ops bench-host bench-budget clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(PIP) --upgrade pip setuptools wheel
	$(PIP) torch==2.13.0
	$(PIP) -e '.[all]'
	# backpack pulls PyPI's torchvision, a CUDA build whose ops fail to load beside the CPU
	# torch; lightning and transformers import it when present, so it must not be there.
	$(BIN)/python -m pip uninstall -y -q torchvision
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/batchbound demo

# One pytest worker per core, at most four (pytest-xdist): most of the suite's time is
# processes it starts and waits on (ranks, runners, killed and resumed runs).
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# CUDA and NCCL paths (each test skips, naming why, on a machine without a GPU). On a GPU
# machine install the CUDA torch build first: `make install` pins the CPU one.
test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

# ruff, then dead code: a function, class, constant or method nothing uses (tools/deadcode.py)
lint: install
	$(BIN)/ruff check .
	$(BIN)/python tools/deadcode.py

bench: install
	$(BIN)/python benchmarks/diversity.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# Operations per step of watch, the callbacks and measure() against a plain step, counted by
# the torch profiler on CPU: the deterministic stand-in for their GPU cost (docs/benchmarks.md).
bench-ops: install
	$(BIN)/python benchmarks/ops.py

# The host's time per step of watch and measure() on CPU, in milliseconds, on a model whose
# arithmetic is small: what a GPU step waits on where the host bounds it (docs/benchmarks.md).
bench-host: install
	$(BIN)/python benchmarks/host.py

# measure(memory_budget=...)'s whole run against its budget, CPU peaks (docs/benchmarks.md).
bench-budget: install
	$(BIN)/python benchmarks/budget.py
