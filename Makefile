# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install prometheus demo test test-fast bench dashboards clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m proxy demo

prometheus:
	scripts/ensure-prometheus.sh

test: $(STAMP) prometheus
	$(PY) -m pytest

dashboards: $(STAMP)
	$(PY) dashboards/generate.py

test-fast: $(STAMP)
	$(PY) -m pytest -m "not e2e"

bench: $(STAMP)
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache
