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

# Two pytest workers (pytest-xdist): the tests on the session's Ray instance in one, those with a Ray of
# their own in the other (tests/conftest.py), the rest spread over both. TEST_WORKERS=0 runs them serially.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup) $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/plait bench throughput
	$(VENV)/bin/plait bench balance

# The docs site (MkDocs, generated reference pages): warnings are errors, as in CI (tests/project/test_docs.py).
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
