# Two commands: `make run` (install + run the example pipeline on the embedded
# database) and `make test` (install test dependencies + run the suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip --disable-pip-version-check -q
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
apt_install = $(SUDO) sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	apt-get install -y -qq --no-install-recommends $(1)'

.PHONY: run test soak lint bench install install-test system-deps clean dist

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

# Browser tests drive Debian's Chromium; promtool checks the shipped alert rules;
# tests/test_pooler.py runs Debian's PgBouncer.
system-deps:
	@command -v chromium >/dev/null 2>&1 || $(call apt_install,chromium)
	@command -v promtool >/dev/null 2>&1 || $(call apt_install,prometheus) || \
		echo "promtool unavailable: the alert-rules test will be skipped"
	@command -v docker-compose >/dev/null 2>&1 || $(call apt_install,docker-compose) || \
		echo "docker-compose unavailable: deploy/compose.yaml is checked in Python only"
	@{ command -v patroni && command -v etcd; } >/dev/null 2>&1 || \
		$(call apt_install,patroni etcd-server) || \
		echo "patroni/etcd-server unavailable: the database failover test will be skipped"
	@command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || \
		$(call apt_install,pgbouncer) || \
		echo "pgbouncer unavailable: the connection-pooler test will be skipped"

# Three xdist workers, each with its own throwaway PostgreSQL cluster.
TEST_WORKERS ?= 3
test: install-test system-deps
	$(BIN)/ruff check pgflow tests
	$(BIN)/pytest -q -n $(TEST_WORKERS)

# The chaos soak of tests/chaos.py for minutes (make test runs a 40 s version).
SOAK_SECONDS ?= 600
soak: install-test
	PGFLOW_SOAK_SECONDS=$(SOAK_SECONDS) $(BIN)/pytest -q -s tests/test_chaos.py

# dist/pgflow: one executable file (a PEX zipapp with every dependency) that needs only
# a CPython of DIST_PYTHONS on Linux of this machine's architecture (glibc): psycopg's
# and pydantic-core's wheels are platform wheels. Built from the wheel of this tree.
DIST_PYTHONS ?= 311 312 313
DIST_ARCH    := $(shell uname -m)
DIST_SOURCES := pyproject.toml README.md $(shell find pgflow sql -type f \
	\( -name '*.py' -o -name '*.sql' -o -name '*.html' -o -name py.typed \) 2>/dev/null)

dist: dist/pgflow

dist/pgflow: $(DIST_SOURCES) | $(BIN)/python
	$(PIP) install 'pex>=2.20'
	@# From a clean copy: setuptools' in-tree build/lib keeps files deleted since.
	rm -rf build/dist-src build/dist-wheel && mkdir -p build/dist-src
	cp -R pyproject.toml README.md pgflow sql build/dist-src/
	find build/dist-src -name __pycache__ -prune -exec rm -rf {} +
	$(BIN)/pip --disable-pip-version-check wheel -q --no-deps -w build/dist-wheel build/dist-src
	mkdir -p dist
	$(BIN)/pex build/dist-wheel/pgflow-*.whl --entry-point pgflow.cli:main \
		--python-shebang '/usr/bin/env python3' -o $@.tmp \
		$(foreach v,$(DIST_PYTHONS),--platform manylinux2014_$(DIST_ARCH)-cp-$(v)-cp$(v))
	mv $@.tmp $@
	@echo "built $@: run it with any python3 >= 3.11 ($(DIST_PYTHONS)), e.g. ./$@ serve"

lint: install-test
	$(BIN)/ruff check pgflow tests
	$(BIN)/mypy pgflow

# BENCH_ARGS=--quick for the ~2-minute subset; BENCH_PG_URL to use a running server.
bench: install
	@$(PIP) install -e '.[bench]'
	@$(BIN)/python -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
