# Tangram: two commands for a fresh machine.
#   make demo   set up everything, start the local stack, run the reference application
#   make test   set up everything, run every test (unit + integration against the real stack)
#   make bench  every benchmark in one run on the local stack; writes README.md's performance table
# The stack stays up after `make demo` until `make down`.

SHELL        := /bin/bash
PYTHON       ?= $(shell command -v python3.11 || command -v python3)
VENV         := .venv
TRITON_VENV  := .venv-triton
FLINK_VENV   := .venv-flink
FEAST_VENV   := .venv-feast
QUIX_VENV    := .venv-quix
BIN          := $(VENV)/bin
UV           := $(PYTHON) -m uv
DURATION     ?= 60
#: The app `make demo` runs (a folder with topology.yaml); `make demo APP=topologies/<other>` runs another.
APP          ?= topologies/predictive_maintenance
# Helm (tests of the chart `tangram deploy k8s` renders), built from its Go module and cached per version.
HELM_VERSION := v3.22.0
HELM         := $(HOME)/.cache/tangram/bin/helm-$(HELM_VERSION)
export TANGRAM_HELM := $(HELM)

.PHONY: setup demo test unit integration bench bench-quick bench-stack up down status clean system-deps jars model uv helm

setup: system-deps $(VENV)/.installed $(TRITON_VENV)/.installed $(FLINK_VENV)/.installed $(FEAST_VENV)/.installed jars model

# Java and Maven come with the machine; Redis comes from Debian's packages.
system-deps:
	@command -v java >/dev/null || { echo "Java 17+ is required (apt-get install openjdk-17-jre-headless)"; exit 1; }
	@command -v mvn  >/dev/null || { echo "Maven is required to fetch the Kafka jars (apt-get install maven)"; exit 1; }
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server from Debian's packages"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
	@command -v mosquitto >/dev/null || test -x /usr/sbin/mosquitto || { \
	  echo "installing mosquitto (MQTT broker for the ingest gateway tests) from Debian's packages"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null; }
	@command -v dot >/dev/null || { \
	  echo "installing graphviz (tangram diagram) from Debian's packages"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null; }
	@test -f /usr/share/fonts/truetype/wqy/wqy-microhei.ttc || { \
	  echo "installing fonts-wqy-microhei (the CJK font of the document-intake generator) from Debian's packages"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-wqy-microhei >/dev/null; }

# uv creates the virtual environments (fast, cached); installed into the base interpreter if missing.
uv:
	@$(PYTHON) -m uv --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv

# 1. The application environment (streams, inference workers, CLI).
$(VENV)/.installed: pyproject.toml | uv
	$(UV) venv -q --allow-existing -p $(PYTHON) $(VENV)
	$(UV) pip install -q -p $(BIN)/python -e '.[dev,intake]'
	@touch $@

# 2. The model-server environment: Triton as PyTriton ships it (numpy<2, so apart).
$(TRITON_VENV)/.installed: inference_workers/requirements-triton.txt | uv
	$(UV) venv -q --allow-existing -p $(PYTHON) $(TRITON_VENV)
	$(UV) pip install -q -p $(TRITON_VENV)/bin/python -r inference_workers/requirements-triton.txt
	@touch $@

# 3. The Flink job environment: PyFlink pins apache-beam, pandas<2.3 and pyarrow, so apart too.
$(FLINK_VENV)/.installed: streams/flink/requirements-flink.txt | uv
	$(UV) venv -q --allow-existing -p $(PYTHON) $(FLINK_VENV)
	$(UV) pip install -q -p $(FLINK_VENV)/bin/python -r streams/flink/requirements-flink.txt
	@touch $@

# 4. The Feast environment: Feast pulls dask, pandas and pyarrow and constrains redis, so apart too.
$(FEAST_VENV)/.installed: streams/feast/requirements-feast.txt | uv
	$(UV) venv -q --allow-existing -p $(PYTHON) $(FEAST_VENV)
	$(UV) pip install -q -p $(FEAST_VENV)/bin/python -r streams/feast/requirements-feast.txt
	@touch $@

# 5. The peer of the end-to-end benchmark: Quix Streams pins an older confluent-kafka, so apart too (bench only).
$(QUIX_VENV)/.installed: benchmarks/peers/requirements-quix.txt | uv
	$(UV) venv -q --allow-existing -p $(PYTHON) $(QUIX_VENV)
	$(UV) pip install -q -p $(QUIX_VENV)/bin/python -r benchmarks/peers/requirements-quix.txt
	@touch $@

# Kafka 4.x jars, resolved by Maven from Maven Central (cached in ~/.m2 between runs).
jars: $(VENV)/.installed
	$(BIN)/tangram stack jars
	$(BIN)/python -m streams.flink.launcher jars

# The reference apps' models, built by each app's own `models.build` hook: predictive maintenance trains
# its model; document intake copies PP-OCRv4 out of the installed rapidocr-onnxruntime wheel.
model: $(VENV)/.installed
	$(BIN)/tangram models build topologies/predictive_maintenance
	$(BIN)/tangram models build topologies/document_intake

# Helm is a Go module: built with this machine's Go (its module and build caches in ~/go and ~/.cache/go-build
# make a rebuild quick), kept under ~/.cache/tangram/bin like the Kafka jars in ~/.m2.
helm: $(HELM)

$(HELM):
	@command -v go >/dev/null || { echo "Go is required to build Helm ($(HELM_VERSION))"; exit 1; }
	mkdir -p $(@D)
	gobin=$$(mktemp -d) && GOBIN=$$gobin go install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION) \
	  && mv $$gobin/helm $@ && rmdir $$gobin

up: setup
	$(BIN)/tangram up

down:
	@if [ -x $(BIN)/tangram ]; then $(BIN)/tangram down; fi

status:
	$(BIN)/tangram status

demo: setup
	$(BIN)/tangram up
	$(BIN)/tangram models build $(APP)
	$(BIN)/tangram apply $(APP)
	$(BIN)/tangram demo $(APP) --duration $(DURATION)

# Every benchmark, one after the other on the local stack with both reference apps applied, then
# README.md's performance table from that run.
bench: bench-stack
	$(BIN)/python benchmarks/run_all.py

# The same chain with small N: every benchmark runs, no README table (a smoke test of the benchmarks).
bench-quick: bench-stack
	$(BIN)/python benchmarks/run_all.py --quick

bench-stack: setup $(QUIX_VENV)/.installed
	$(BIN)/tangram up
	$(BIN)/tangram apply topologies/predictive_maintenance
	$(BIN)/tangram apply topologies/document_intake

test: setup helm
	$(BIN)/tangram schemas check topologies/predictive_maintenance
	$(BIN)/tangram schemas check topologies/document_intake
	$(BIN)/pytest -q --durations=25 tests

unit: $(VENV)/.installed helm
	$(BIN)/pytest -q tests/unit

integration: setup
	$(BIN)/pytest -q tests/integration

clean: down
	rm -rf "$${TANGRAM_HOME:-$$HOME/.tangram}" $(VENV) $(TRITON_VENV) $(FLINK_VENV) $(FEAST_VENV) $(QUIX_VENV)
