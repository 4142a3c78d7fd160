# Two commands: `make run` (install + run the example pipeline on the embedded
# database) and `make test` (install test dependencies + run the suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip --disable-pip-version-check -q

.PHONY: run test lint bench install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(PIP) install -e '.[test]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(BIN)/pgflow db migrate
	$(BIN)/pgflow apply examples/etl/pipeline.toml
	$(BIN)/pgflow jobs list

test: install-test
	$(BIN)/ruff check pgflow tests
	$(BIN)/pytest -q

lint: install-test
	$(BIN)/ruff check pgflow tests
	$(BIN)/mypy pgflow

bench: install-test
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) build *.egg-info
