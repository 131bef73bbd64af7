# Two entry points on a fresh machine: `make demo` and `make test`. Both create .venv if needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: demo test install clean

$(VENV)/.runtime: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) -e '.[test]'
	touch $@

install: $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(PY) -m flows.demo

.PHONY: demo-s3
demo-s3: $(VENV)/.test
	$(PY) -m flows.demo --s3

test: $(VENV)/.test
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) demo .pytest_cache
