# Carpool's interface: `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
export CARPOOL_CACHE ?= $(HOME)/.cache/carpool

.DEFAULT_GOAL := help
.PHONY: help dev binaries lint test test-unit e2e cluster cluster-down node node-down demo bench proto helm-lint chart-crds images images-check registry-tools push gpu-check gpu-latency gpu-lending gpu-node-stage gpu-node device-bench-stage device-bench clean

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

# The editable install is strict (it links each module, so mypy sees the files): a module added
# or removed since the last install needs a new one. The stamp is named by the module list.
MODULES := $(shell find src operator extender deviceplugin testbed -name '*.py' -not -path '*/build/*' 2>/dev/null | sort | cksum | cut -d' ' -f1)
INSTALLED := $(VENV)/.installed-$(MODULES)

$(INSTALLED): pyproject.toml setup.py testbed/pyproject.toml
	@echo "==> [dev] creating $(VENV) and installing carpool (editable, strict)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install -q -e '.[dev]' -e ./testbed --config-settings editable_mode=strict
	@rm -f $(VENV)/.installed*; touch $@

dev: $(INSTALLED) ## Create the virtualenv with Carpool and its dev tools (again when modules change)

binaries: ## Build (once, cached in ~/.cache/carpool) Kubernetes, etcd, KWOK, Helm from the Go module proxy
	@bash hack/build-k8s.sh

proto: dev ## Regenerate the device-plugin gRPC stubs from the proto
	@$(PY) -m carpool.deviceplugin.api.generate

lint: dev ## ruff, mypy (strict, the package and bench/), import-linter, proto drift
	@echo "==> [lint] ruff"; $(VENV)/bin/ruff check .
	@echo "==> [lint] mypy"; $(VENV)/bin/mypy && $(VENV)/bin/mypy bench
	@echo "==> [lint] import-linter"; $(VENV)/bin/lint-imports
	@echo "==> [lint] proto stubs up to date"; $(PY) -m carpool.deviceplugin.api.generate --check

test-unit: dev ## Unit tests only (no cluster)
	@$(VENV)/bin/pytest -m "not cluster" tests

test: ## Everything CI runs: lint, unit and integration tests (real API server and kube-scheduler), the real-kubelet node, the chart installed on it
	@bash hack/timed.sh dev $(MAKE) --no-print-directory dev
	@bash hack/timed.sh binaries bash hack/build-k8s.sh
	@bash hack/timed.sh lint $(MAKE) --no-print-directory lint
	@bash hack/timed.sh tests $(VENV)/bin/pytest tests
	@bash hack/timed.sh real-node $(VENV)/bin/pytest e2e/test_real_node.py e2e/test_lending_real_node.py
	@bash hack/timed.sh chart $(VENV)/bin/pytest e2e/test_chart_install.py

e2e: dev binaries ## Long end-to-end runs (real kubelet node, load and faults)
	@$(VENV)/bin/pytest e2e

cluster: dev binaries ## Start the local cluster (real control plane, KWOK nodes, Carpool scheduler)
	@$(PY) -m carpool_testbed.devcluster up

cluster-down: dev ## Stop the local cluster (and the demo's operator and extender)
	@$(PY) -m carpool_testbed.stack down
	@$(PY) -m carpool_testbed.devcluster down

node: dev binaries ## Join a real node (containerd, runc, kubelet, device plugin) to the running cluster; root
	@$(PY) -m carpool_testbed.realnode up

node-down: dev ## Stop the real node and delete its Node
	@$(PY) -m carpool_testbed.realnode down

demo: dev binaries ## Bring up Carpool on the local cluster with simulated GPU nodes and show it working
	@$(PY) -m carpool_testbed.demo

bench: dev ## Run the benchmarks under bench/
	@$(PY) bench/placement.py

helm-lint: binaries ## Lint the Helm chart (and check its CRD copies match crds/)
	@bash hack/sync-chart-crds.sh --check
	@$$(bash hack/build-k8s.sh | tail -1)/helm lint --strict helm/carpool

chart-crds: ## Copy crds/ into the Helm chart (after editing a CRD)
	@bash hack/sync-chart-crds.sh

images: dev ## Build the images carpool and carpool-mps (docker/podman if one runs, else OCI layouts in build/images)
	@tool=$${CONTAINER_TOOL:-$$(for t in docker podman; do command -v $$t >/dev/null && $$t info >/dev/null 2>&1 && echo $$t && break; done)}; \
	if [ -n "$$tool" ]; then \
	  echo "==> [images] $$tool build"; \
	  $$tool build -f docker/Dockerfile -t $${IMAGE_REPO:-ghcr.io/carpool-dev}/carpool:$$($(PY) hack/images/build.py --print-version) . && \
	  $$tool build -f docker/mps.Dockerfile -t $${IMAGE_REPO:-ghcr.io/carpool-dev}/carpool-mps:$$($(PY) hack/images/build.py --print-version) docker; \
	else \
	  echo "==> [images] no container engine: building OCI layouts from Debian packages and wheels"; \
	  $(PY) hack/images/build.py --out build/images $(IMAGES_ARGS); \
	fi

images-check: dev ## Build the images twice without an engine and compare every digest
	@$(PY) hack/images/build.py --out build/images --check-reproducible

registry-tools: ## Build (once, cached in ~/.cache/carpool) the CNCF distribution registry and crane
	@bash hack/build-registry.sh

push: registry-tools ## Push build/images to REGISTRY (default: the local registry, started if needed)
	@bash hack/images/push.sh

gpu-check: ## On a GPU machine: NVML inventory, MPS limits and the sharing benchmark
	@python3 bench/gpu_sharing.py $(GPU_CHECK_ARGS)

gpu-latency: ## On a GPU machine: services with P99 targets, Carpool's sharing vs fixed degrees 1-6
	@python3 bench/latency_sharing.py $(GPU_LATENCY_ARGS)

gpu-lending: ## On a GPU machine: lending's owner reclaim and the watchdog with real MPS clients
	@python3 bench/lending_gpu.py $(GPU_LENDING_ARGS)

gpu-node-stage: dev ## Stage binaries, images and this commit for `make gpu-node` on an offline GPU machine (.gpunode/)
	@bash hack/gpu-node/stage.sh $(GPU_NODE_STAGE)

gpu-node: ## On a GPU machine (root): control plane, real node, the chart with NVML; the Must-show list through pods
	@bash hack/gpu-node/run.sh $(GPU_NODE_ARGS)

device-bench-stage: dev ## Stage binaries and Python packages for `make device-bench` on an offline 16-core machine (.devbench/)
	@bash hack/device-bench/stage.sh $(DEVICE_BENCH_STAGE)

device-bench: ## With .devbench/: extender pods/s end to end (bench/extender.py --cluster), no extender vs null vs Carpool's
	@bash hack/device-bench/run-extender.sh

clean: ## Remove the virtualenv and caches in the repo
	rm -rf $(VENV) build *.egg-info testbed/build testbed/*.egg-info .mypy_cache .ruff_cache .pytest_cache
