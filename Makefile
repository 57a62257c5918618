# Nexus Flow Runtime — developer entry points. `make help` lists them.
# The two README commands are `make run` and `make test`; both bootstrap everything they need.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TOOLS := .tools
BUF := $(TOOLS)/node_modules/.bin/buf
PROTO_SRC := $(shell find protos -name '*.proto' 2>/dev/null)
PROTO_STAMP := .proto-stamp
INSTALL_STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help run test test-fast proto lint bench clean db-upgrade db-verify

help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-12s %s\n", $$1, $$2}'

$(INSTALL_STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	@touch $@

$(PROTO_STAMP): $(INSTALL_STAMP) $(PROTO_SRC) scripts/gen_protos.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) scripts/gen_protos.py
	@touch $@

proto: $(INSTALL_STAMP) ## Regenerate Python code from protos/ (grpcio-tools + mypy-protobuf)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) scripts/gen_protos.py
	@touch $(PROTO_STAMP)

run: $(PROTO_STAMP) ## Start catalog, runtime and effect-owner on embedded SQLite under ./.data, with the demo Flows
	$(PY) -m flowctl.devstack

test: $(PROTO_STAMP) ## Run every test: unit, integration (SQLite + MariaDB when FLOW_TEST_MYSQL_URL is set), e2e, crash
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(PROTO_STAMP) ## Unit tests only
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

$(BUF):
	npm install --silent --no-audit --no-fund --prefix $(TOOLS) @bufbuild/buf@1 >/dev/null

lint: $(PROTO_STAMP) $(BUF) ## ruff, mypy --strict, and buf lint on the protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	BUF_CACHE_DIR=$(CURDIR)/$(TOOLS)/buf-cache $(BUF) lint

bench: $(PROTO_STAMP) ## Benchmarks: print figures and ratios (SQLite; MariaDB with FLOW_TEST_MYSQL_URL; a cluster with FLOW_BENCH_CLUSTER_URLS)
	$(PY) -m bench

db-upgrade: $(PROTO_STAMP) ## Migrate the three embedded databases to head
	$(PY) -m catalog_svc db upgrade && $(PY) -m runtime_svc db upgrade && $(PY) -m effect_owner_svc db upgrade

db-verify: $(PROTO_STAMP) ## Compare the live schemas with the models
	$(PY) -m catalog_svc db verify && $(PY) -m runtime_svc db verify && $(PY) -m effect_owner_svc db verify

clean: ## Remove the venv, generated code, tool installs and ./.data
	rm -rf $(VENV) $(TOOLS) .data services/proto/nexus .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
