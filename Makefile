# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two processes, a test file each at a time (a file's deployments and fixtures stay in
# one; tests/conftest.py groups them, a model family apart): most served tests wait on
# processes and timeouts, so two run in about 60% of one's time even on two cores.
# PYTEST_WORKERS=0 runs the suite in this process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadscope)

.PHONY: install test test-fast serve fetch bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

fetch: install
	$(VENV)/bin/llmbus model fetch

test: install
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_PARALLEL) $(PYTEST_ARGS)

serve: fetch
	$(VENV)/bin/llmbus serve

bench: fetch
	$(VENV)/bin/llmbus bench throughput

clean:
	rm -rf $(VENV) .venv-clients *.egg-info .pytest_cache
