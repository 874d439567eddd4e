# icefall-lite: `make test` and `make demo` each set themselves up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test

setup:
	@VENV=$(VENV) bash scripts/setup.sh

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)
