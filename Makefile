# The two commands of the README. Both install everything they need into .venv, from scratch.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.neuronc-installed

.PHONY: demo test install clean system-tools

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if v == (3, 11) else "neuronc needs Python 3.11; set PYTHON=python3.11 (found %d.%d)" % v)'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build of 2.13.0 is on disk; anything else pulls a CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# the neuron device's C++ shim (g++ and ninja), so that `import torch` finds it built
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m neuronc.pytorch.shim
	# byte-compiled as pip compiles an installed package (an editable install is not, and with
	# PYTHONDONTWRITEBYTECODE set never is): a new process does not compile neuronc's modules from source
	$(BIN)/python -m compileall -q neuronc runtime > /dev/null
	touch $(STAMP)

install: $(STAMP)

# Debian tools the tests use: flatc (flatbuffers-compiler) for the NEFF schema freshness test,
# Chromium to check that profile reports render. Without root they are skipped, with a message;
# in CI (CI=true) the tests that need them fail instead (tests/conftest.py, require_tool).
system-tools:
	@command -v flatc >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq flatbuffers-compiler chromium >/dev/null; } \
	  || echo "warning: could not install flatc/chromium; the tests that need them will be skipped (failed in CI)"

demo: $(STAMP)
	$(BIN)/python -m neuronc.demo

# Both cores (pytest-xdist, at most 2 workers: each holds torch and its compiled programs, and the suite must stay
# within 8 GiB), one test file per worker at a time (module-scoped fixtures compile once); the order is shuffled
# (pytest-randomly: the header prints the seed, `-p randomly --randomly-seed=N` repeats it); the slowest 25 listed.
test: $(STAMP) system-tools
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n auto --maxprocesses=2 --dist loadfile --durations=25

clean:
	rm -rf $(VENV) demo_out .pytest_cache
