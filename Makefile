# Two entry points on a fresh machine with only Python: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-split venv bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU build (a looser pin would pull a multi-GB CUDA build).
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/plait demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Every test as `make test` runs them, in two processes at once: the tests that touch Ray (`-m ray`, in the
# serial order: the ones with a Ray of their own, then the session's instance) and all the others. The Ray
# half's report is printed after the other's. Opt-in: at load 25-70 the Ray half's slow starts became failures
# (Ray start/join timeouts); `make test` (serial) is what CI runs.
test-split: $(STAMP)
	@$(PY) -m pytest -m ray -p no:cacheprovider $(PYTEST_ARGS) > $(VENV)/test-ray.log 2>&1 & ray=$$!; \
	$(PY) -m pytest -m "not ray" $(PYTEST_ARGS); others=$$?; \
	wait $$ray; ray_rc=$$?; echo "----- the tests that touch Ray (-m ray):"; cat $(VENV)/test-ray.log; \
	for rc in $$others $$ray_rc; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done

bench: $(STAMP)
	$(VENV)/bin/plait bench throughput
	$(VENV)/bin/plait bench balance

# The docs site (MkDocs, generated reference pages): warnings are errors, as in CI (tests/project/test_docs.py).
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
