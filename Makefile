# Two entry points on a fresh machine with only Python: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
INSTALL := $(PY) .ci/install.py $(VENV)

.PHONY: demo test venv lock bench docs clean

# Bytecode is written as each module is first imported (Python's default), also where the environment sets
# PYTHONDONTWRITEBYTECODE (this machine does): without it every process (each Ray actor, each trainer) would
# compile torch's and plait's modules again as it imports them (`import torch`: 4.7 s instead of 1.8). The
# install compiles nothing: compiling every file of every package (torch's test suites too) took ~45 s of a
# fresh install for modules that are never imported; the first import compiles what is used, ~4 s.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml constraints-dev.txt .ci/install.py
	$(PYTHON) -m venv $(VENV)
	# uv installs (.ci/install.py: with pip's indexes; pip where uv cannot be had). First setuptools (it builds
	# plait's editable install without an isolated build env), numpy and numba: all that the balancer's
	# kernels need to compile.
	$(INSTALL) -q -c constraints-dev.txt setuptools wheel numpy numba
	# numba's kernels then compile into their on-disk cache (~40 s of CPU on one core: .ci/warm_kernels.py)
	# while plait, torch and the dev extras install, and on while `make test` starts pytest: the install does
	# not wait for it; the few test processes that compile wait for it (tests/conftest.py). torch pinned: the
	# CPU build (a looser pin would pull a multi-GB CUDA build).
	PYTHONPATH=src $(PY) .ci/warm_kernels.py $(VENV) > $(VENV)/numba-warmup.log 2>&1 &
	$(INSTALL) -q --no-build-isolation -c constraints-dev.txt -e '.[dev]' torch==2.13.0
	touch $(STAMP)

# constraints-dev.txt anew from the current venv: after a change to pyproject.toml's dependencies.
lock: $(STAMP)
	$(PIP) install -q -e '.[dev]'
	{ sed -n '1,4p' constraints-dev.txt; $(PIP) freeze --all --exclude-editable | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/'; } > constraints-dev.txt.new
	mv constraints-dev.txt.new constraints-dev.txt

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/plait demo

# Two pytest workers (pytest-xdist): the Ray tests on the session's instance in one, those that start a Ray
# of their own in the other (tests/conftest.py: with more workers, more groups), the rest spread over both.
# More workers do not help on 2 cores: three (one Ray group of each kind) took 489-516 s of tests against
# 460-482 s with two (2026-12-03, the Ray groups working). TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup) $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.throughput
	$(VENV)/bin/python -m benchmarks.balance

# The docs site (MkDocs, generated reference pages): warnings are errors, as in CI (tests/project/test_docs.py).
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
