# Two entry points on a fresh machine with only Python: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test venv bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU build (a looser pin would pull a multi-GB CUDA build).
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/plait demo

# Every test, on TEST_WORKERS processes (pytest-xdist): the tests that touch Ray run on one of them, in order
# (tests/conftest.py), each other module whole on one. `make test TEST_WORKERS=0` runs them in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

bench: $(STAMP)
	$(VENV)/bin/plait bench throughput
	$(VENV)/bin/plait bench balance

# The docs site (MkDocs, generated reference pages): warnings are errors, as in CI (tests/test_docs.py).
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
