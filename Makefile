# Two commands: `make run` (install + run the example pipeline on the embedded
# database) and `make test` (install test dependencies + run the suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip --disable-pip-version-check -q
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
apt_install = $(SUDO) sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	apt-get install -y -qq --no-install-recommends $(1)'

.PHONY: run test lint bench install install-test system-deps clean

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
	@echo "admin token for the UI at http://127.0.0.1:8080/login (shown once):"
	@$(BIN)/pgflow token create --role admin --note "make run"
	exec $(BIN)/pgflow serve

# Browser tests drive Debian's Chromium; promtool checks the shipped alert rules.
system-deps:
	@command -v chromium >/dev/null 2>&1 || $(call apt_install,chromium)
	@command -v promtool >/dev/null 2>&1 || $(call apt_install,prometheus) || \
		echo "promtool unavailable: the alert-rules test will be skipped"

test: install-test system-deps
	$(BIN)/ruff check pgflow tests
	$(BIN)/pytest -q

lint: install-test
	$(BIN)/ruff check pgflow tests
	$(BIN)/mypy pgflow

# BENCH_ARGS=--quick for the ~2-minute subset; BENCH_PG_URL to use a running server.
bench: install
	@$(PIP) install -e '.[bench]'
	@$(BIN)/python -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
