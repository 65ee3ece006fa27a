# Developer entry points. `make test` is what CI runs (.ci/run).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.install.stamp
JDBC_JAR ?= /usr/share/java/postgresql.jar
PYTEST_ARGS ?=
DEMO_ARGS ?=

# Spark workers must import from the venv, not the system Python.
export PYSPARK_PYTHON ?= $(abspath $(VPY))
export PYSPARK_DRIVER_PYTHON ?= $(abspath $(VPY))

# Checks used by `make java` (each is a shell condition).
java_ok = java -version 2>&1 | grep -E 'version "(1[7-9]|[2-9][0-9])[."]' >/dev/null
jar_ok = test -f "$(JDBC_JAR)"
pg_ok = test -n "$${DATABASE_URL:-}" || test -x "$${PG_BIN:-/nonexistent}/initdb" \
	|| ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
	|| { test -x $(VPY) && $(VPY) -c 'from buffered_store.dev.services import find_pg_bindir as f; f()' >/dev/null 2>&1; }

.PHONY: help install .venv java test test-fast demo lint clean distclean

help:
	@echo "make install    venv + pip install -e '.[dev]' (redone when pyproject.toml changes)"
	@echo "make java       check/install Java 17+, the PostgreSQL JDBC jar and PostgreSQL binaries"
	@echo "make test       the whole test suite (what CI runs; NATS, Postgres and Spark)"
	@echo "make test-fast  unit tests and the in-memory contract and conformance suites (no services, under a minute)"
	@echo "make demo       run the demo"
	@echo "make lint       ruff check, ruff format --check, mypy"
	@echo "make clean      caches and build output (distclean also removes .venv)"

$(VPY):
	$(PYTHON) -m venv $(VENV)

# -qq: only errors. Machines with a pip.conf listing index folders that do not exist get
# a warning per package otherwise, drowning the demo's own output; PIP_VERBOSE=1 shows all.
PIP_QUIET ?= -qq
$(STAMP): pyproject.toml | $(VPY)
	@echo "make: installing the package and its dependencies into $(VENV) (about a minute the first time)"
	$(VPY) -m pip install $(PIP_QUIET) -e '.[dev]'
	@echo "make: $(VENV) is ready"
	@touch $@

install .venv: $(STAMP)

java:
	@pkgs=""; \
	if ! $(java_ok); then \
	  if command -v apt-cache >/dev/null && apt-cache show openjdk-17-jre-headless >/dev/null 2>&1; \
	  then pkgs="$$pkgs openjdk-17-jre-headless"; else pkgs="$$pkgs default-jre-headless"; fi; \
	fi; \
	$(jar_ok) || pkgs="$$pkgs libpostgresql-jdbc-java"; \
	$(pg_ok) || pkgs="$$pkgs postgresql"; \
	if [ -n "$$pkgs" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "make java: installing$$pkgs"; \
	    apt-get update -qq; \
	    DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y -qq --no-install-recommends $$pkgs; \
	  else \
	    echo "make java: missing$$pkgs" >&2; \
	    echo "  Need Java 17+ (java -version), the PostgreSQL JDBC driver at $(JDBC_JAR)" >&2; \
	    echo "  and PostgreSQL server binaries (or PG_BIN=dir, or DATABASE_URL=an existing server)." >&2; \
	    echo "  Debian/Ubuntu: sudo apt-get install$$pkgs" >&2; \
	    exit 1; \
	  fi; \
	fi; \
	$(java_ok) || { echo "make java: Java 17+ still missing (java -version)" >&2; exit 1; }; \
	$(jar_ok) || { echo "make java: $(JDBC_JAR) still missing" >&2; exit 1; }; \
	$(pg_ok) || { echo "make java: PostgreSQL server binaries still missing" >&2; exit 1; }; \
	echo "make java: ok ($$(java -version 2>&1 | head -n1); JDBC jar $(JDBC_JAR))"

# The suite runs in TEST_WORKERS pytest-xdist processes (most tests wait on servers and
# child processes, so a 2-core machine runs three at once); each worker starts its own
# throwaway servers unless NATS_URL/DATABASE_URL name shared ones. TEST_WORKERS=0 runs
# everything in one process.
TEST_WORKERS ?= 3
test: install java
	@echo "test services: NATS=$${NATS_URL:-throwaway nats-server} Postgres=$${DATABASE_URL:-throwaway cluster} mode=$${BUFSTORE_SERVICES:-local} workers=$(TEST_WORKERS)"
	$(VPY) -m pytest tests/ -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# No services, no Java: unit tests and every contract/conformance suite over the in-memory
# implementations. BUFSTORE_TEST_NO_SERVICES makes a test that asks for NATS or Postgres
# error out (tests/plugins/services.py) instead of quietly starting them.
FAST_TESTS ?= tests/unit tests/contracts
test-fast: install
	BUFSTORE_TEST_NO_SERVICES=1 $(VPY) -m pytest $(FAST_TESTS) -m "not integration and not spark and not e2e and not chaos" $(PYTEST_ARGS)

demo: install java
	$(VPY) -m buffered_store.dev.demo $(DEMO_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info $(STAMP)
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
